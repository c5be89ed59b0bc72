"""tests/test_gpu.py's calls on CPU at tiny shapes: the GPU tests run nowhere else (no GPU here), so an API
they call that drifted (a removed constant, an argument of another type) would first fail on a lent GPU,
whose minutes are few. Each GPU test runs here as written, its GPU-only checks skipped (`on_gpu()`)."""

import pytest
import test_gpu

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16)
# In the fast tier (issue 54): 45 worker-s for the five in the full suite on the idle 2-core box (2026-12-06,
# AMD EPYC family 25), ~10 train steps and 40 decode calls; 970 s only under load 16-20.
CALLS = [name for name in dir(test_gpu) if name.startswith("test_")]


def test_every_gpu_test_is_called_here():
  assert len(CALLS) == 5, CALLS  # a GPU test added must run here too (it is, by name)


@pytest.mark.parametrize("name", CALLS)
def test_gpu_test_calls_run_on_cpu(name, monkeypatch):
  assert not test_gpu.on_gpu()
  monkeypatch.setattr(test_gpu, "SHAPES", TINY)
  getattr(test_gpu, name)()
