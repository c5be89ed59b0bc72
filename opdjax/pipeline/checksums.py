"""Content checksums of a checkpoint's arrays, independent of how they are sharded.

An array held whole in this process's host memory (every array of a one-process CPU run) gets zlib's CRC-32 of its
bytes in C order: every single-bit flip (and every burst up to 32 bits) is caught, and at 2.8 GB/s on the 2-core
box it is the fastest hash installed (sha256 1.2 GB/s; crc32c and xxhash are not installed;
bench/checkpoint_integrity.py). An array on accelerators or spread over processes gets an on-device sum, so nothing
is gathered to one host.

The sum is two 32-bit sums over the elements: element i's bits (as 32-bit words), keyed by i, through a bijective
32-bit mixer (murmur3's finalizer), summed modulo 2**32. Because the mixer is a bijection and the key is xor-ed
(lane a) or added (lane b) before it, changing any one element changes each lane's sum: every single-bit flip is
caught, not only most of them. Other damage goes unseen with a chance near 2**-64. The sum is order-free, so the
checksum of a global `jax.Array` does not depend on how it is sharded: jit reduces over every process's shards (the
value every process reads is the same) and a restore into other shardings computes the value the save recorded.

A host hash needs the array's bytes in order on one host; the sum does not (on XLA:CPU it ran at 0.13-0.7 GB/s
under load, which is why CPU arrays take the CRC). The kind is recorded with the value (`crc32:`, `sum:`) and a
restore computes the recorded kind, whatever the restored layout. In the sum, elements past 2**32 share keys with
earlier ones: an array that large keeps single-flip detection (the word still changes) but a swap of two elements
2**32 apart would go unseen.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np


def _mix(x):
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _words(x):
  """The array's bits as uint32 words (one per element, two for 8-byte elements)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: a trailing axis of two words


@functools.partial(jax.jit)
def _checksum(x):
  w = _words(x).reshape(-1)
  i = jax.lax.iota(jnp.uint32, w.shape[0])
  a = jnp.sum(_mix(w ^ _mix(i + jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)
  b = jnp.sum(_mix(w + _mix(i ^ jnp.uint32(0x7F4A7C15))), dtype=jnp.uint32)
  return jnp.stack([a, b])


def _on_host(x) -> bool:
  """`x`'s data are all in this process's host memory (numpy, or jax arrays on this process's CPU devices)."""
  if not isinstance(x, jax.Array):
    return True
  return x.is_fully_addressable and all(d.platform == "cpu" for d in x.sharding.device_set)


def _host_bytes(x) -> memoryview:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:  # a crc32 recorded at save, read back spread out
    from jax.experimental import multihost_utils

    x = multihost_utils.process_allgather(x, tiled=True)
  if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return memoryview(np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8))


def _checksum_of(x, kind: str):
  """`kind` crc32: zlib's CRC-32 of the array's bytes in C order (on the host: 2.8 GB/s here, no copy of a
  CPU array); sum: the on-device sum above (one collective over every process's shards)."""
  if kind == "crc32":
    return f"crc32:{zlib.crc32(_host_bytes(x)):08x}"
  # Read back before the next array's: on XLA:CPU several processes' programs run asynchronously, and two
  # collectives in flight at once paired up across processes in different orders (the two-process lag run's
  # final save hung with process 0 in one array's sum and process 1 in another's).
  return np.asarray(_checksum(x if isinstance(x, jax.Array) else jnp.asarray(x)))


def tree_checksums(tree, kinds: dict[str, str] | None = None) -> dict[str, str]:
  """{array path (jax.tree_util.keystr): checksum} for every array leaf of `tree`: `crc32:...` for an array
  held whole in this process's host memory, `sum:...` for one on accelerators or spread over processes.
  `kinds` ({path: kind}): compute those kinds instead (a restore checks what the save recorded, whatever the
  restored layout). Every process must call it with the same tree (a global array's sum is a collective)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  jax.block_until_ready([x for _, x in leaves if isinstance(x, jax.Array)])  # no program of the tree's in flight
  out = {}
  for path, x in leaves:
    if not isinstance(x, (jax.Array, np.ndarray)) or not np.size(x):
      continue
    key = jax.tree_util.keystr(path)
    kind = (kinds or {}).get(key) or ("crc32" if _on_host(x) else "sum")
    out[key] = _checksum_of(x, kind)
  return {k: v if isinstance(v, str) else "sum:" + "".join(f"{int(w):08x}" for w in np.asarray(v))
          for k, v in out.items()}


def mismatches(recorded: dict[str, str], tree) -> list[str]:
  """The paths of `tree`'s arrays whose checksum differs from `recorded` (arrays it does not list are not
  checked: a checkpoint written before checksums existed)."""
  got = tree_checksums(tree, {k: v.split(":")[0] for k, v in recorded.items()})
  return [k for k, v in recorded.items() if k in got and got[k] != v]
