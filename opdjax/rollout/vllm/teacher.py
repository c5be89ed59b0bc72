"""A teacher served by vLLM: its log-probs of a rollout's completion tokens, and its top-K, from its own servers.

Scoring is one batched request per server per call: every row's real tokens (the prompt without its left
padding, the completion without its right padding) as a token-id prompt, `prompt_logprobs=K`, one generated
token (vLLM generates at least one: the servers' max_model_len is max_len + 1). vLLM 0.32 answers, for every
prompt position i >= 1, log p(seq[i] | seq[:i]) with the top-K tokens (ranks 1..K) beside it. These are the
log_softmax of the raw logits at temperature 1 (no sampling setting reaches prompt positions) in every
logprobs mode but raw_logits / processed_logits, which answer unnormalised logits: a server in those modes is
refused. A teacher temperature other than 1 is the caller's to apply. Only completion targets are read; vLLM
computes the prompt positions too (a request with prompt log-probs does not read its prefix cache).

/server_info (dev mode) reports the logprobs mode, max_logprobs and max_model_len, but not the vocabulary
(its JSON leaves out hf_config): a probe finds it, vLLM's check of `logprob_token_ids` accepting id V - 1
and refusing id V.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import math
import re
import time

import jax
import numpy as np

from opdjax.errors import ServerFailed, UserError
from opdjax.rollout.vllm.client import ServerDown, VllmClient, VllmError, error_message, http_json
from opdjax.rollout.vllm.launch import check_base_url, make_vllm_server, servers_load_together

UNNORMALISED_MODES = ("raw_logits", "processed_logits")
URL_PREFIXES = ("http://", "https://")  # a teacher.routes target that is a running server, not a folder
PROBE_K = 20  # the top-K a teacher pre-flight asks for (opdjax.pipeline.teacher_preflight); vLLM's default limit
RETRIES = 2  # a connection error is tried again this many times (1 s, then 2 s later) before the run stops


class TeacherServerError(VllmError, ServerFailed):
  """A teacher server died, stopped answering or answered something unusable; the message names it."""


class ServedTeacher:
  """The teacher's log-probs from `vcfg.num_servers` vLLM servers serving `model_dir` (started here, with
  the rollout servers' supervision, token and cleanup), or from the running servers `vcfg.attached`.

  `vcfg`: the teacher's own VllmConfig (dtype, extra_args, ...). `topk`: 0 scores only the sampled token
  (sampled_rkl); K > 0 adds the teacher's top K per position (topk_rkl; the servers started here get
  `--max-logprobs max(K, PROBE_K)`). `vocab_size`: the student's, which every server's must equal. Logs go to
  OUT/vllm-NAME.log (OUT/vllm-NAME-I.log for several). `close()` stops the servers started here.
  """

  def __init__(self, vcfg, model_dir: str | None, *, max_len: int, batch_size: int, topk: int, vocab_size: int,
               out_dir: str, name: str = "teacher", token: str | None = None):
    if not 0 <= topk <= vocab_size:
      raise UserError(f"{name}: top-K={topk} must be between 0 (the sampled token only) and the vocabulary size"
                      f" {vocab_size}.")
    self.name, self.topk, self.vocab_size, self.max_len = name, topk, vocab_size, max_len
    self.servers: list = []  # the servers started here (None where attached)
    self._pool: cf.ThreadPoolExecutor | None = None
    urls = list(vcfg.attached)
    try:
      if urls:
        for url in urls:
          check_base_url(url, f"{name}.vllm.url(s)")
        self.servers = [None] * len(urls)
      else:
        n = vcfg.num_servers
        self.servers = [make_vllm_server(vcfg, model_dir, max_len=max_len + 1, batch_size=batch_size,
                                         out_dir=out_dir, index=i if n > 1 else None, name=f"vllm-{name}",
                                         extra_args=("--max-logprobs", str(max(topk, PROBE_K)))) for i in range(n)]
        if servers_load_together(vcfg):
          for server in self.servers:
            server.launch()
        for server in self.servers:
          server.start()
        urls = [server.url for server in self.servers]
      self.urls = [u.rstrip("/") for u in urls]
      # A server started here checks its own token (the job's); an attached one, `token` (another trainer
      # process's servers) or the environment's.
      self.clients = [VllmClient(u, api_key=vcfg.api_key or None, token=token if srv is None else srv.token or "")
                      for u, srv in zip(self.urls, self.servers, strict=True)]
      for client in self.clients:
        self._check(client)
    except BaseException:
      self.close()
      raise
    if len(self.clients) > 1:
      self._pool = cf.ThreadPoolExecutor(len(self.clients), thread_name_prefix=f"opdjax-{name}")

  @property
  def token(self) -> str | None:
    """The token its servers check (what another trainer process attaches with)."""
    return self.clients[0].token if self.clients else None

  def logprob_limit(self, url: str) -> int | None:
    """The --max-logprobs of its server at `url` (None: no limit)."""
    limit = self.clients[self.urls.index(url)].config().get("model_config", {}).get("max_logprobs")
    return None if limit in (None, -1) else limit

  def _check(self, client: VllmClient) -> None:
    check_server(client, self.name, topk=self.topk, max_len=self.max_len)
    theirs = self._probe_vocab(client)
    if theirs != self.vocab_size:
      raise UserError(f"the {self.name} server at {client.url} has a vocabulary of {theirs} tokens, the student's"
                      f" {self.vocab_size}: a teacher server whose vocabulary differs from the student's cannot score"
                      " the student's tokens; serve a teacher with the student's tokenizer and vocabulary.")

  def _probe_vocab(self, client: VllmClient) -> int | str:
    """The server's vocabulary size: `vocab_size` when it takes id V - 1 and refuses id V in
    `logprob_token_ids`; else what its refusal says (or a bound)."""
    status = {}
    for tok in (self.vocab_size - 1, self.vocab_size):
      body = {"prompt": [0], "max_tokens": 1, "logprobs": 1, "logprob_token_ids": [tok],
              "return_tokens_as_token_ids": True}  # (a server without a tokenizer answers log-probs only so)
      try:
        # A server's first completion may compile (bf16 kernels on a CPU took over 60 s under load in CI):
        # the probe waits as long as any scoring request does.
        status[tok], payload = http_json(client.url + "/v1/completions", body, bearer=client.bearer,
                                         timeout=client.request_timeout_s)
      except (OSError, http.client.HTTPException) as e:
        raise UserError(f"the {self.name} server at {client.url} did not answer the vocabulary probe within"
                        f" {client.request_timeout_s:.0f} s at start-up ({e}); check its log.") from None
      if status[tok] not in (200, 400):
        raise UserError(f"the {self.name} server at {client.url} answered the vocabulary probe with HTTP"
                        f" {status[tok]}: {error_message(payload)}")
      if status[tok] == 400:
        said = re.search(r"Vocabulary size: (\d+)", error_message(payload))
        if said is None:
          raise UserError(f"the {self.name} server at {client.url} refused the vocabulary probe:"
                          f" {error_message(payload)}")
        return int(said[1])
    return f"more than {self.vocab_size}"

  def score(self, rollout) -> dict[str, np.ndarray]:
    """The teacher's fp32 log-probs in the batch layout `[B, L = P + N - 1]` (opdjax.scoring.rescore): position
    j scores target j + 1. `teacher_logprobs` [B, L] (0 off the loss mask); with K > 0 also `teacher_topk_ids`
    [B, L, K] int32 and `teacher_topk_logprobs` [B, L, K], by rank; off the loss mask ids 0..K-1 and log-probs
    -log(V), finite, so masked arithmetic never makes a NaN."""
    pt, pm, ct, cm = (np.asarray(jax.device_get(x)) for x in (rollout.prompt_tokens, rollout.prompt_mask,
                                                              rollout.completion_tokens, rollout.completion_mask))
    (b, p), k = pt.shape, self.topk
    length = p + ct.shape[1] - 1
    out = {"teacher_logprobs": np.zeros((b, length), np.float32)}
    if k:
      out["teacher_topk_ids"] = np.broadcast_to(np.arange(k, dtype=np.int32), (b, length, k)).copy()
      out["teacher_topk_logprobs"] = np.full((b, length, k), -math.log(self.vocab_size), np.float32)
    rows, seqs, starts = [], [], []
    for i in range(b):
      done, real = np.flatnonzero(cm[i]), np.flatnonzero(pm[i])
      if not len(done):
        continue
      if not len(real):
        raise UserError(f"{self.name}: row {i} of the rollout has no prompt token; every prompt needs one.")
      seq = [*pt[i, real[0]:].tolist(), *ct[i, :done[-1] + 1].tolist()]
      if min(seq) < 0 or max(seq) >= self.vocab_size or len(seq) > self.max_len:
        raise UserError(f"{self.name}: row {i} of the rollout has {len(seq)} tokens (max_len {self.max_len}) with"
                        f" ids {min(seq)}..{max(seq)}, outside the vocabulary of {self.vocab_size}; an id beyond"
                        " it kills a vLLM server.")
      rows.append(i)
      seqs.append(seq)
      starts.append(p - real[0])
    shares = [s for s in np.array_split(np.arange(len(rows)), len(self.clients)) if len(s)]
    jobs = [(j, [seqs[r] for r in share], [starts[r] for r in share]) for j, share in enumerate(shares)]
    answers = list((self._pool.map if self._pool else map)(lambda job: self._score_share(*job), jobs))
    for share, answer in zip(shares, answers, strict=True):
      for r, (lp, ids, tlp) in zip(share, answer, strict=True):
        i, c = rows[r], np.flatnonzero(cm[rows[r]])
        pos = p - 1 + c  # batch position p - 1 + c predicts completion token c
        out["teacher_logprobs"][i, pos] = lp[c]
        if k:
          out["teacher_topk_ids"][i, pos] = ids[c]
          out["teacher_topk_logprobs"][i, pos] = tlp[c]
    return out

  def _score_share(self, j: int, seqs: list[list[int]], starts: list[int]):
    body = {"prompt": seqs, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": self.topk}
    client, server = self.clients[j], self.servers[j]
    for attempt in range(RETRIES + 1):
      try:
        payload = client.completions(body)
        break
      except ServerDown as e:
        if server is not None and not server.running:
          raise TeacherServerError(f"the {self.name} server at {client.url} died ({e}); its log is"
                                   f" {server.log_path}.") from None
        if attempt == RETRIES:
          raise TeacherServerError(f"the {self.name} server at {client.url} stopped answering ({e}), {RETRIES + 1}"
                                   " times; check it and its log, then resume the run.") from None
        time.sleep(2.0 ** attempt)
      except VllmError as e:
        raise TeacherServerError(f"the {self.name} server at {client.url}: {e}") from None
    return parse_answer(payload, seqs, starts, url=client.url, topk=self.topk, vocab_size=self.vocab_size,
                        name=self.name)

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._pool = None
    for server in self.servers:
      if server is not None:
        server.stop()
    self.servers = [None] * len(self.servers)

  def __enter__(self) -> ServedTeacher:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def check_teacher_servers(urls, api_key: str = "", *, topk: int, max_len: int, name: str = "teacher") -> None:
  """The start-up checks of attached teacher servers that need no model (opdjax.rollout.deploy.plan, before
  anything is written): base URLs, reachable with the job's token or key, dev mode, normalised prompt
  log-probs, `--max-logprobs` >= K, room for `max_len` tokens. The vocabulary is checked when the served
  teacher starts (ServedTeacher), against the student's."""
  for url in urls:
    check_base_url(url, f"{name}.vllm.url(s)")
    check_server(VllmClient(url, api_key=api_key or None), name, topk=topk, max_len=max_len)


def check_server(client: VllmClient, name: str, *, topk: int, max_len: int) -> None:
  """One teacher server answers as scoring needs (see `check_teacher_servers`); one UserError naming it."""
  who = f"the {name} server at {client.url}"
  try:
    model = client.config().get("model_config", {})
  except ServerDown as e:
    raise UserError(f"no vLLM server answers at {client.url} for the {name} ({e}); start it first, or leave"
                    f" {name}.vllm.url(s) empty so that opdjax starts one. Nothing was written.") from None
  mode, limit, max_model_len = model.get("logprobs_mode"), model.get("max_logprobs"), model.get("max_model_len")
  if mode in UNNORMALISED_MODES:
    raise UserError(f"{who} runs with --logprobs-mode {mode}, whose prompt log-probs are unnormalised logits;"
                    " restart it with --logprobs-mode processed_logprobs (or raw_logprobs).")
  if limit != -1 and (not isinstance(limit, int) or limit < max(topk, 1)):
    raise UserError(f"{who} allows {limit} log-probs per position (--max-logprobs) but the {name}'s top-K is"
                    f" {topk} (loss.topk): restart it with --max-logprobs {max(topk, 1)} or more, or lower K.")
  if isinstance(max_model_len, int) and max_model_len < max_len + 1:
    raise UserError(f"{who} has max_model_len={max_model_len}; scoring sequences of up to {max_len} tokens needs"
                    f" {max_len + 1} (one generated token): restart it with --max-model-len {max_len + 1}.")


def parse_answer(payload, seqs, starts, *, url: str, topk: int, vocab_size: int, name: str = "teacher"):
  """Per prompt `seqs[i]`, its positions from `starts[i]` on: (log-probs [n], top-K ids [n, K], top-K log-probs
  [n, K]) from a /v1/completions answer with prompt log-probs; one error naming `url` when it is malformed."""

  def bad(what: str) -> TeacherServerError:
    return TeacherServerError(f"the {name} server at {url} answered a scoring request with {what}; it must be vLLM"
                              " >= 0.32 serving the teacher's model: check its log.")

  choices = payload.get("choices") if isinstance(payload, dict) else None
  if not isinstance(choices, list) or sorted(c.get("index", -1) if isinstance(c, dict) else -1
                                             for c in choices) != list(range(len(seqs))):
    raise bad(f"no one choice per prompt ({len(seqs)} prompts)")
  by_index = {c["index"]: c for c in choices}
  out = []
  for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
    entries = by_index[i].get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(seq):
      got = len(entries) if isinstance(entries, list) else "none"
      raise bad(f"prompt log-probs of {got} positions for prompt {i} of {len(seq)} tokens")
    n = len(seq) - start
    lp, ids, tlp = np.zeros(n, np.float32), np.zeros((n, topk), np.int32), np.zeros((n, topk), np.float32)
    for c in range(n):
      entry = entries[start + c]
      try:
        table = [(int(v["rank"]), float(v["logprob"]), int(t)) for t, v in entry.items()]
        own = float(entry[str(seq[start + c])]["logprob"])
      except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise bad(f"a malformed entry at position {start + c} of prompt {i} ({type(e).__name__}: {e})") from None
      values = [v for _, v, _ in table]
      if not all(math.isfinite(v) and v <= 1e-3 for v in values):
        raise bad(f"a log-prob that is not finite or above 0 at position {start + c} of prompt {i}: {values}")
      if any(not 0 <= t < vocab_size for *_, t in table):
        raise bad(f"a token id outside the vocabulary of {vocab_size} at position {start + c} of prompt {i}")
      top = sorted((r, -v, t) for r, v, t in table if r <= topk)
      if len(top) < topk:
        raise bad(f"{len(top)} top entries at position {start + c} of prompt {i}, not {topk}")
      lp[c] = own
      ids[c] = [t for *_, t in top[:topk]]
      tlp[c] = [-v for _, v, _ in top[:topk]]
    out.append((lp, ids, tlp))
  return out
