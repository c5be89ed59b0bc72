"""Scale-out on JAX's multi-controller runtime, below the model and the engines: the device mesh and
its axis names (mesh), the partition rules (rules), sharding hints for activations (activations) and
where a run's arrays live (placement). Process start-up is the pipeline's (opdjax.pipeline.distributed)."""
