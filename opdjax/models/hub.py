"""Models by Hugging Face Hub id: `org/name` or `org/name@revision` -> a local snapshot folder.

`huggingface_hub.snapshot_download` fetches the config, tokenizer and safetensors files into the HF cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub) and returns the snapshot's folder;
with `HF_HUB_OFFLINE=1` it is read from that cache alone. Without the variable, an offline node (a compute
node of a cluster) needs no flag: the Hub's address is tried first, for at most `PROBE_TIMEOUT_S`, and
when it (or any later request) cannot be reached, a repo in the cache is read from there with one line
saying so; one that is not gets one line naming the cache, HF_HUB_OFFLINE and how to fill it (a missing
local folder shaped like `dir/name` is the same case: the line names both readings). The snapshot commit
read for each id is kept (`read_snapshots`) for the run's config record. Only safetensors weights load: a repo that
offers only pickle files (`*.bin`, `*.pt`, `*.pth`) is refused, since unpickling runs code the repo
ships. Both variables are read at each call (not at import), so a process may set them late.
"""

from __future__ import annotations

import fnmatch
import os
import re
import socket
import sys
import urllib.parse

from opdjax.errors import UserError

# org/name with an optional @revision (branch, tag or commit); a path that exists locally is a folder.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")
WANTED = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja")  # config, weights, tokenizer files
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
OFFLINE_VALUES = ("1", "on", "yes", "true")
PROBE_TIMEOUT_S = 1.5  # the connect to the Hub's address; a node without network fails at once or by then
_READ: dict[str, str] = {}  # Hub id -> the snapshot commit read for it in this process


def read_snapshots() -> dict[str, str]:
  """{Hub id: snapshot commit} of every id resolved in this process (what the run's config record keeps)."""
  return dict(_READ)


def _network_errors() -> tuple[type[BaseException], ...]:
  """The error classes a request huggingface_hub makes raises when the network fails (httpx in recent
  versions, requests in older ones), with OSError (sockets, DNS)."""
  out: list[type[BaseException]] = [OSError]
  for name in ("httpx2", "httpx"):  # huggingface_hub 2.x ships its fork httpx2
    try:
      out.append(__import__(name).TransportError)  # ConnectError, timeouts, proxy errors
    except (ImportError, AttributeError):
      pass
  try:
    import requests

    out += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
  except ImportError:
    pass
  return tuple(out)


def _reachable() -> str:
  """'' when the Hub's address accepts a connection within PROBE_TIMEOUT_S, else why not."""
  from huggingface_hub import constants

  url = urllib.parse.urlparse(constants.ENDPOINT)
  try:
    with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                  timeout=PROBE_TIMEOUT_S):
      return ""
  except OSError as e:
    return f"{type(e).__name__}: {e}"


def is_hub_id(spec: str) -> bool:
  """`spec` names a Hub repo (and is not a folder that exists here)."""
  return bool(HUB_ID.match(spec)) and not os.path.exists(spec)


def hub_cache() -> str:
  """The HF cache huggingface_hub reads, from the environment as it is now."""
  if os.environ.get("HF_HUB_CACHE"):
    return os.environ["HF_HUB_CACHE"]
  home = os.environ.get("HF_HOME") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
  return os.path.join(home, "hub")


def offline() -> bool:
  return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in OFFLINE_VALUES


def split_id(spec: str) -> tuple[str, str | None]:
  repo, _, rev = spec.partition("@")
  return repo, rev or None


def _refuse_pickle(spec: str, files: list[str]) -> None:
  names = [os.path.basename(f) for f in files]
  if any(fnmatch.fnmatch(n, "*.safetensors") for n in names):
    return
  pickled = sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in PICKLED))
  if pickled:
    raise UserError(f"{spec} offers only pickle weights ({', '.join(pickled[:3])}); opdjax loads safetensors only"
                    " (unpickling runs code the repo ships): use a revision or repo with *.safetensors, or convert"
                    " it (transformers' save_pretrained writes safetensors) and give the folder.")
  raise UserError(f"{spec} has no *.safetensors weights; give a repo (or revision) that has them.")


def snapshot(spec: str) -> str:
  """The local snapshot folder of Hub id `spec` (downloaded when online, from the cache offline or when the
  Hub cannot be reached)."""
  path = _snapshot(spec)
  _READ[spec] = os.path.basename(os.path.normpath(path))  # snapshots/<commit>
  return path


def _cached(spec: str, cache: str) -> str | None:
  from huggingface_hub import snapshot_download
  from huggingface_hub.errors import LocalEntryNotFoundError

  repo, rev = split_id(spec)
  try:
    return snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=True, allow_patterns=list(WANTED))
  except (LocalEntryNotFoundError, OSError, ValueError):
    return None


def _from_cache_unreachable(spec: str, cache: str, why: str) -> str:
  """The Hub cannot be reached (`why`): the cached snapshot of `spec`, said in one line, or one line refusing."""
  path = _cached(spec, cache)
  if path is None:
    local = os.path.abspath(split_id(spec)[0])
    raise UserError(f"{spec} is neither a local folder ({local} does not exist) nor a Hub repo in the Hugging Face"
                    f" cache {cache}, and the Hub cannot be reached ({why[:100]}): give an existing folder, or fill"
                    f" the cache where there is network (`hf download {split_id(spec)[0]}` with HF_HUB_CACHE={cache})"
                    " and read it here with or without HF_HUB_OFFLINE=1.")
  print(f"opdjax: the Hub cannot be reached ({why[:100]}); {spec} is read from the Hugging Face cache {cache}"
        f" (snapshot {os.path.basename(os.path.normpath(path))}). Set HF_HUB_OFFLINE=1 to skip the attempt.",
        file=sys.stderr)
  return path


def _snapshot(spec: str) -> str:
  from huggingface_hub import snapshot_download
  from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
  )

  repo, rev = split_id(spec)
  cache, local = hub_cache(), offline()
  network = _network_errors()
  if not local:
    why = _reachable()
    if why:
      path = _from_cache_unreachable(spec, cache, why)
      _refuse_pickle(spec, os.listdir(path))
      return _checked(spec, path)
  if not local:  # what the repo offers, before any weight is downloaded
    from huggingface_hub import HfApi

    try:
      _refuse_pickle(spec, HfApi().list_repo_files(repo, revision=rev))
    except (RepositoryNotFoundError, GatedRepoError) as e:
      raise UserError(f"{spec}: no such model repo on the Hub, or it needs a token ({type(e).__name__}); check the"
                      " id, log in (`hf auth login` / HF_TOKEN), or give a local folder.") from None
    except RevisionNotFoundError:
      raise UserError(f"{spec}: the repo has no revision {rev!r}; give a branch, tag or commit it has.") from None
    except network as e:  # the address answered, the requests did not (HfHubHTTPError is an OSError): as unreachable
      path = _from_cache_unreachable(spec, cache, f"{type(e).__name__}: {e}")
      _refuse_pickle(spec, os.listdir(path))
      return _checked(spec, path)
  try:
    path = snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=local, allow_patterns=list(WANTED))
  except LocalEntryNotFoundError as e:
    if not local:  # online, but the files could not be fetched and are not cached
      return _checked(spec, _from_cache_unreachable(spec, cache, f"{type(e).__name__}"))
    raise UserError(f"{spec} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids downloading it:"
                    " unset HF_HUB_OFFLINE (or run once online), or point HF_HUB_CACHE at a cache that holds it.") \
        from None
  except (RepositoryNotFoundError, RevisionNotFoundError, HfHubHTTPError) as e:
    raise UserError(f"{spec}: the snapshot did not download ({type(e).__name__}: {str(e)[:160]}).") from None
  except network as e:
    path = _from_cache_unreachable(spec, cache, f"{type(e).__name__}: {e}")
  if local:  # offline: what the cached snapshot holds (a pickle-only repo has no safetensors there)
    _refuse_pickle(spec, os.listdir(path))
  return _checked(spec, path)


def _checked(spec: str, path: str) -> str:
  if not os.path.exists(os.path.join(path, "config.json")):
    raise UserError(f"{spec}: the snapshot {path} has no config.json; is it a transformers model repo?")
  return path
