"""The embedded JAX rollout engine against re-scoring with the same fp32 params."""


import jax
import numpy as np
import pytest
import scipy.stats
from helpers import log_softmax, top_p_keep

from opdjax.models import Model, ModelConfig
from opdjax.rollout import JaxEngine, PromptTooLongError, SamplingParams
from opdjax.scoring.rescore import batch_from_rollout

PAD = 0
N_NEW = 6
MAX_LEN = 8 + N_NEW  # prompts pad to 8; the longest prompt that fits is exactly 8 tokens
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8], [11, 2, 30, 6, 6]]
GREEDY = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
TEMP1 = SamplingParams(max_new_tokens=N_NEW, temperature=1.0)
TRUNCATED = SamplingParams(max_new_tokens=N_NEW, temperature=0.7, top_k=3, top_p=0.8)


@pytest.fixture(scope="module")
def model():
  return Model(ModelConfig(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8))


@pytest.fixture(scope="module")
def params(model, random_params):
  # Large weights: peaked next-token distributions (max prob ~0.45), far from uniform.
  return random_params(model, seed=0, std=0.5)


@pytest.fixture(scope="module")
def engine(model, params):
  return JaxEngine(model, params, max_len=MAX_LEN, pad_id=PAD, eos_ids=(), version=1)


@pytest.fixture(scope="module")
def greedy(engine):
  return engine.generate(PROMPTS, GREEDY, seed=0)


@pytest.fixture(scope="module")
def logits_fn(model):
  return jax.jit(model.apply)


def next_token_logits(logits_fn, params, r):
  """Model logits predicting each completion token `[B, N, V]`, from one full pass."""
  batch = batch_from_rollout(r)
  logits, _ = logits_fn(params, batch["tokens"], batch["positions"], batch["attention_mask"])
  return np.asarray(logits, np.float64)[:, r.prompt_tokens.shape[1] - 1:]


@pytest.mark.slow
@pytest.mark.parametrize("sp", [GREEDY, TEMP1], ids=["greedy", "temperature1"])
def test_rollout_logprobs_match_rescoring(sp, engine, params, score, greedy):
  r = greedy if sp is GREEDY else engine.generate(PROMPTS, sp, seed=1)
  mask = np.asarray(r.completion_mask)
  assert mask.all()  # no EOS configured: every row runs to max_new_tokens
  lps = np.asarray(r.rollout_logprobs)
  np.testing.assert_allclose(lps[mask], score(params, r)[mask], atol=1e-4, rtol=0)
  assert lps.max() < -1e-3 and np.ptp(lps) > 0.1  # informative, not a point mass


@pytest.mark.slow
def test_truncated_sampling_reports_renormalised_logprobs(engine, params, score, logits_fn):
  r = engine.generate(PROMPTS, TRUNCATED, seed=2)
  lps = np.asarray(r.rollout_logprobs)
  tokens = np.asarray(r.completion_tokens)

  # Reference, vLLM order: temperature, then top-k, then the smallest top-p prefix.
  z = next_token_logits(logits_fn, params, r) / TRUNCATED.temperature
  kth = -np.sort(-z, -1)[..., TRUNCATED.top_k - 1:TRUNCATED.top_k]
  top_k_only = np.where(z >= kth, z, -np.inf)
  keep = top_p_keep(top_k_only, TRUNCATED.top_p)
  # Both cuts bind somewhere: top-p alone would keep more than k, or top-p keeps fewer than k.
  kept = keep.sum(-1)
  assert np.any((kept == TRUNCATED.top_k) & (top_p_keep(z, TRUNCATED.top_p).sum(-1) > TRUNCATED.top_k))
  assert np.any(kept < TRUNCATED.top_k)
  assert np.take_along_axis(keep, tokens[..., None], -1).all()  # only kept tokens are sampled
  ref = np.take_along_axis(log_softmax(np.where(keep, z, -np.inf)), tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(lps, ref, atol=1e-4, rtol=0)

  # Temperature alone spreads mass over the removed tokens: truncation can only raise log-probs.
  temp_only = score(params, r, temperature=TRUNCATED.temperature)
  assert np.all(lps >= temp_only - 1e-5)
  assert np.max(lps - temp_only) > 1e-2


def test_seed_fixes_the_rollout(engine):
  a, b = engine.generate(PROMPTS, TEMP1, seed=3), engine.generate(PROMPTS, TEMP1, seed=3)
  c = engine.generate(PROMPTS, TEMP1, seed=4)
  for x, y in [(a.completion_tokens, b.completion_tokens), (a.rollout_logprobs, b.rollout_logprobs)]:
    np.testing.assert_array_equal(x, y)
  assert a.seed == 3
  assert np.mean(np.asarray(a.completion_tokens) != np.asarray(c.completion_tokens)) > 0.3


@pytest.mark.slow
def test_batched_greedy_equals_each_prompt_alone(engine, greedy):
  rows = np.asarray(greedy.completion_tokens)
  assert len({tuple(row) for row in rows}) == len(PROMPTS)  # distinct prompts, distinct completions
  for i, prompt in enumerate(PROMPTS):
    alone = engine.generate([prompt], GREEDY, seed=0)
    np.testing.assert_array_equal(np.asarray(alone.completion_tokens)[0], rows[i])
    np.testing.assert_allclose(np.asarray(alone.rollout_logprobs)[0], np.asarray(greedy.rollout_logprobs)[i],
                               atol=1e-5)


def test_greedy_is_argmax_of_the_model(greedy, params, logits_fn):
  logits = next_token_logits(logits_fn, params, greedy)
  np.testing.assert_array_equal(np.asarray(greedy.completion_tokens), logits.argmax(-1))


@pytest.mark.slow
def test_eos_stops_a_row(model, params, greedy, score, check_eos_stop):
  base = np.asarray(greedy.completion_tokens)
  # EOS := the first token of row 0 that row 0 has not emitted before, after step 0.
  stop = next(j for j in range(1, N_NEW - 1) if base[0, j] not in base[0, :j])
  eos = int(base[0, stop])
  r = JaxEngine(model, params, max_len=MAX_LEN, pad_id=PAD, eos_ids=(eos,)).generate(PROMPTS, GREEDY, seed=0)
  mask = check_eos_stop(r, base, eos, PAD)
  assert mask[0].sum() == stop + 1 < N_NEW
  np.testing.assert_allclose(np.asarray(r.rollout_logprobs)[mask], score(params, r)[mask], atol=1e-4)


@pytest.mark.slow
def test_top_k_1_is_greedy(engine, greedy):
  r = engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, temperature=1.0, top_k=1), seed=5)
  np.testing.assert_array_equal(np.asarray(r.completion_tokens), np.asarray(greedy.completion_tokens))
  # ...but it reports the truncated distribution (a point mass), not the model's.
  np.testing.assert_array_equal(np.asarray(r.rollout_logprobs), 0.0)
  assert np.asarray(greedy.rollout_logprobs).max() < -1e-3


def test_prompt_too_long(engine):
  engine.generate([list(range(1, 9))], GREEDY, seed=0)  # 8 + 6 == max_len fits
  with pytest.raises(PromptTooLongError, match="max_len"):
    engine.generate([list(range(1, 10))], GREEDY, seed=0)
  with pytest.raises(PromptTooLongError, match="max_len"):
    engine.generate([[1, 2], list(range(1, 9))], SamplingParams(max_new_tokens=N_NEW + 1, temperature=0.0))


def test_params_version_follows_sync(engine, model, params, random_params, score, greedy):
  assert engine.params_version == 1 and greedy.params_version == 1
  new = random_params(model, seed=1, std=0.5)
  engine.sync(new, version=3)
  try:
    r = engine.generate(PROMPTS, GREEDY, seed=0)
  finally:
    engine.sync(params, version=1)
  assert r.params_version == 3 and greedy.params_version == 1
  assert np.mean(np.asarray(r.completion_tokens) != np.asarray(greedy.completion_tokens)) > 0.3
  np.testing.assert_allclose(np.asarray(r.rollout_logprobs), score(new, r), atol=1e-4)
  assert np.abs(np.asarray(r.rollout_logprobs) - score(params, r)).max() > 1e-2
  assert engine.generate([PROMPTS[0]], GREEDY, seed=0).params_version == 1


@pytest.mark.slow
def test_sampled_token_frequencies_match_the_distribution(engine, params, logits_fn):
  rows = 4000
  prompt = PROMPTS[1]
  r = engine.generate([prompt] * rows, SamplingParams(max_new_tokens=1, temperature=1.0), seed=6)
  first = r.replace(**{k: getattr(r, k)[:1] for k in ("prompt_tokens", "prompt_mask", "completion_tokens",
                                                       "completion_mask", "rollout_logprobs")})
  logits = next_token_logits(logits_fn, params, first)[0, 0]
  tokens = np.asarray(r.completion_tokens)[:, 0]
  np.testing.assert_allclose(np.asarray(r.rollout_logprobs)[:, 0], log_softmax(logits)[tokens], atol=1e-4)
  counts = np.bincount(tokens, minlength=logits.shape[-1])

  def chi2(probs):
    """Pearson statistic, pooling tokens expected fewer than 5 times into one cell."""
    expected = rows * probs
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return np.sum((obs - exp) ** 2 / exp), len(obs) - 1

  stat, dof = chi2(np.exp(log_softmax(logits)))
  bound = scipy.stats.chi2.ppf(1 - 1e-6, dof)  # a false alarm once in a million runs
  assert dof >= 10 and stat < bound, (stat, bound)
  # The bound has power: the same counts reject a mildly sharper distribution.
  wrong, wrong_dof = chi2(np.exp(log_softmax(logits / 0.85)))
  assert wrong > scipy.stats.chi2.ppf(1 - 1e-6, wrong_dof), wrong
