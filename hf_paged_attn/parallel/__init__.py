"""Tensor parallelism: rank 0 drives one engine, the other ranks follow a broadcast step.
Imports ``runtime`` and below."""

from .tensor_parallel import WorkerReport, claim, is_driver, is_tensor_parallel, leave, run_worker, serve_worker

__all__ = ["WorkerReport", "claim", "is_driver", "is_tensor_parallel", "leave", "run_worker", "serve_worker"]
