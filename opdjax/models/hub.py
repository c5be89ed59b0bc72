"""Models by Hugging Face Hub id: `org/name` or `org/name@revision` -> a local snapshot folder.

`huggingface_hub.snapshot_download` fetches the config, tokenizer and safetensors files into the HF cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub) and returns the snapshot's folder;
with `HF_HUB_OFFLINE=1` it is read from that cache alone. Only safetensors weights load: a repo that
offers only pickle files (`*.bin`, `*.pt`, `*.pth`) is refused, since unpickling runs code the repo
ships. Both variables are read at each call (not at import), so a process may set them late.
"""

from __future__ import annotations

import fnmatch
import os
import re

from opdjax.errors import UserError

# org/name with an optional @revision (branch, tag or commit); a path that exists locally is a folder.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")
WANTED = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja")  # config, weights, tokenizer files
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
OFFLINE_VALUES = ("1", "on", "yes", "true")


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
  """The local snapshot folder of Hub id `spec` (downloaded when online, from the cache offline)."""
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
  if not local:  # what the repo offers, before any weight is downloaded
    from huggingface_hub import HfApi

    try:
      _refuse_pickle(spec, HfApi().list_repo_files(repo, revision=rev))
    except (RepositoryNotFoundError, GatedRepoError) as e:
      raise UserError(f"{spec}: no such model repo on the Hub, or it needs a token ({type(e).__name__}); check the"
                      " id, log in (`hf auth login` / HF_TOKEN), or give a local folder.") from None
    except RevisionNotFoundError:
      raise UserError(f"{spec}: the repo has no revision {rev!r}; give a branch, tag or commit it has.") from None
    except (HfHubHTTPError, OSError) as e:
      raise UserError(f"{spec}: the Hub cannot be reached ({type(e).__name__}: {str(e)[:120]}); set HF_HUB_OFFLINE=1"
                      f" to load it from the cache {cache}, or give a local folder.") from None
  try:
    path = snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=local, allow_patterns=list(WANTED))
  except LocalEntryNotFoundError:
    raise UserError(f"{spec} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids downloading it:"
                    " unset HF_HUB_OFFLINE (or run once online), or point HF_HUB_CACHE at a cache that holds it.") \
        from None
  except (RepositoryNotFoundError, RevisionNotFoundError, HfHubHTTPError, OSError) as e:
    raise UserError(f"{spec}: the snapshot did not download ({type(e).__name__}: {str(e)[:160]}).") from None
  if local:  # offline: what the cached snapshot holds (a pickle-only repo has no safetensors there)
    _refuse_pickle(spec, os.listdir(path))
  if not os.path.exists(os.path.join(path, "config.json")):
    raise UserError(f"{spec}: the snapshot {path} has no config.json; is it a transformers model repo?")
  return path
