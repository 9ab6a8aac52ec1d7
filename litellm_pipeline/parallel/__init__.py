"""Tensor and expert parallelism on torch.distributed: what each rank holds (``shard``), the collectives its model
runs (``comm``), and the driver with its worker processes (``workers``). See docs/parallel.md."""
