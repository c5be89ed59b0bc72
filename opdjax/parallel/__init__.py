"""Scale-out on JAX's multi-controller runtime: the device mesh (mesh), the partition rules (rules),
where a run's arrays live (placement) and the multi-process runtime (distributed)."""
