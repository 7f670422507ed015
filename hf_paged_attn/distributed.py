"""Kept for code written against 0.1: tensor parallelism now lives in ``hf_paged_attn.parallel``."""

from .parallel import WorkerReport, is_driver, is_tensor_parallel, run_worker, serve_worker

__all__ = ["WorkerReport", "is_driver", "is_tensor_parallel", "run_worker", "serve_worker"]
