"""The JAX engine family: the embedded engine (`engine`), one engine per engine-view model (`cache`),
the engine in a process of its own on its own cores (`sidecar`) and the teacher scored there
(`teacher`). Never imports opdjax.rollout.vllm."""
