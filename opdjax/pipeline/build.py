"""Builds what a run needs from its config: the task, and the teacher and student (HF folders,
fetched models, or the demo's cached models), pruned with `keep_layers` where asked."""

from __future__ import annotations

import os

import jax
import numpy as np

from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig, load_hf_params
from opdjax.models.fetch import resolve
from opdjax.models.vocab import check_pair, shared_vocab
from opdjax.rollout.vllm.teacher import URL_PREFIXES
from opdjax.tasks.addition import AdditionTask
from opdjax.tasks.demo_models import cached_sft_model
from opdjax.tasks.interface import Task
from opdjax.tasks.prompts import PromptsTask


def _addition_task(cfg) -> AdditionTask:
  task = AdditionTask(cfg.task.max_digits, num_eval=cfg.task.num_eval, answer_format=cfg.task.answer)
  total = task.max_prompt_tokens + task.max_answer_tokens
  if task.answer_format == "worked" and (cfg.rollout.max_new_tokens < task.max_answer_tokens
                                         or cfg.rollout.max_len < total):
    raise UserError(f"task.answer={cfg.task.answer!r} with task.max_digits={cfg.task.max_digits} has answers of up"
                    f" to {task.max_answer_tokens} tokens after prompts of up to {task.max_prompt_tokens}: give"
                    f" rollout.max_new_tokens >= {task.max_answer_tokens} and rollout.max_len >= {total} (now"
                    f" {cfg.rollout.max_new_tokens} and {cfg.rollout.max_len}).")
  return task


def _prompts_task(cfg) -> PromptsTask:
  """A JSONL file (task.path; 'builtin:NAME': opdjax/data/NAME.jsonl) encoded with the teacher's tokenizer, or
  a dataset (task.dataset) rendered with the student's (and its chat template)."""
  if not cfg.teacher.path:
    raise UserError("task.name='prompts' needs teacher.path: an HF folder whose tokenizer encodes the prompts.")
  room = cfg.rollout.max_len - cfg.rollout.max_new_tokens
  if cfg.task.dataset:
    from opdjax.tasks.dataset import DatasetTask

    return DatasetTask(cfg.task, resolve(cfg.student.path or cfg.teacher.path), room)
  path = cfg.task.path
  if path.startswith("builtin:"):
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", path[len("builtin:"):] + ".jsonl")
  return PromptsTask(path, resolve(cfg.teacher.path), cfg.task.num_eval, cfg.task.chat_template, room)


TASKS = {"addition": _addition_task, "prompts": _prompts_task}  # task.name -> its builder


def make_task(cfg) -> Task:
  """The run's task (opdjax.tasks.interface.Task), built by `task.name`'s entry of TASKS."""
  if cfg.task.name not in TASKS:
    raise UserError(f"task.name={cfg.task.name!r}: choose one of {', '.join(map(repr, TASKS))}.")
  return TASKS[cfg.task.name](cfg)


def prune_layers(model_cfg: ModelConfig, params, keep: str):
  """Keeps the layers `keep` selects, renumbered: comma-separated indices and Python slices (`0::2`, `0,3,5`,
  `0:12,18:30`: the middle six of 30 dropped)."""
  n = model_cfg.num_layers
  try:
    kept = []
    for part in keep.split(","):
      if ":" in part:
        kept += list(range(n))[slice(*[int(x) if x else None for x in part.split(":")])]
      else:
        kept.append(int(part))
  except ValueError:
    raise UserError(f"keep_layers={keep!r}: give slices like '0::2' or '0:12,18:30', or indices like '0,3,5'.") \
        from None
  if not kept or any(not 0 <= i < n for i in kept):
    raise UserError(f"keep_layers={keep!r} selects {kept} of a {n}-layer model.")
  idx = np.asarray(kept)
  return model_cfg.replace(num_layers=len(kept)), {**params, "layers": jax.tree.map(lambda x: x[idx], params["layers"])}


def check_task_vocab(who: str, vocab_size: int, task) -> None:
  """A model (`who`: the role, or a route's teacher) covers the task's tokenizer (rows beyond it are padding)."""
  if vocab_size < task.vocab_size:
    raise UserError(f"{who} vocab_size={vocab_size} is smaller than the task's tokenizer ({task.vocab_size} tokens);"
                    " use a model that matches the prompts' tokenizer.")


def teacher_folder(cfg, task) -> tuple[str, ModelConfig]:
  """The HF folder a served teacher's servers load (teacher.serve='vllm') and its config, without keeping its
  params here: `teacher.path`, or the demo's cached teacher (built first when absent)."""
  mc = cfg.teacher
  if mc.path:
    if mc.keep_layers:
      raise UserError(f"teacher.keep_layers={mc.keep_layers!r} prunes the teacher in the trainer; a served teacher's"
                      " servers load its folder as it is: write the pruned teacher to a folder of its own and give it"
                      " as teacher.path, or use teacher.serve='trainer'.")
    path = resolve(mc.path)
    model_cfg = ModelConfig.from_pretrained(path)
  elif isinstance(task, AdditionTask):
    model, _, path = cached_sft_model("teacher", mc, task, cfg.seed)
    model_cfg = model.cfg
  else:
    raise UserError("teacher.path is empty: give an HF safetensors folder for the served teacher.")
  check_task_vocab("teacher", model_cfg.vocab_size, task)
  return path, model_cfg.replace(shared_vocab=_shared_vocab(cfg, model_cfg.vocab_size, task))


def route_targets(cfg, task) -> dict:
  """teacher.routes as tag -> (an HF folder to serve, or None; a running server's base URL, or None), after
  the start-up checks: the task's prompts carry tags, every prompt's tag has a route, and each folder's
  vocabulary is the student's tokenizer's (an attached server's is probed when it is attached)."""
  table = cfg.teacher.route_table
  if not table:
    return {}
  task.check_tags([tag for tag, _ in table])
  out = {}
  for tag, target in table:
    if target.startswith(URL_PREFIXES):
      out[tag] = (None, target)
      continue
    folder = resolve(target)
    check_task_vocab(f"teacher.routes' {tag!r} teacher", ModelConfig.from_pretrained(folder).vocab_size, task)
    out[tag] = (folder, None)
  return out


def _shared_vocab(cfg, model_vocab: int, task) -> int:
  """The ids logits run over (`ModelConfig.shared_vocab`): the tokenizer's, cutting padded rows, where the pair's
  tables differ in size (Qwen2.5-7B's 152064 rows vs 0.5B's 151936); a pair of one table size keeps every row, as
  vLLM (a served teacher, vLLM rollouts) normalizes over its whole table and cannot cut what it returns."""
  rows = {ModelConfig.from_pretrained(resolve(m.path)).vocab_size for m in (cfg.student, cfg.teacher) if m.path}
  if rows <= {model_vocab}:
    return 0
  return shared_vocab(model_vocab, task.vocab_size)


def load_model(role: str, cfg, task):
  """(Model, params) of `role` (teacher or student) from the typed config."""
  mc = getattr(cfg, role)
  if mc.path:
    path = resolve(mc.path)
    model_cfg = ModelConfig.from_pretrained(path)
    params = load_hf_params(path, model_cfg)
    if mc.keep_layers:
      model_cfg, params = prune_layers(model_cfg, params, mc.keep_layers)
  elif isinstance(task, AdditionTask):
    model, params, _ = cached_sft_model(role, mc, task, cfg.seed)
    model_cfg = model.cfg
  else:
    raise UserError(f"{role}.path is empty: give an HF safetensors folder for the {role}.")
  check_task_vocab(role, model_cfg.vocab_size, task)
  model_cfg = model_cfg.replace(dtype=cfg.model.dtype, shared_vocab=_shared_vocab(cfg, model_cfg.vocab_size, task))
  return Model(model_cfg, remat_policy=cfg.model.remat_policy), params


def check_tokenizers(cfg) -> None:
  """The student's and the teacher's tokenizer files, compared by content (opdjax.models.vocab.check_pair)."""
  from opdjax.tasks.prompts import load_tokenizer

  folders = [resolve(p) if p else None for p in (cfg.student.path, cfg.teacher.path)]
  check_pair(*folders, load_tokenizer)
