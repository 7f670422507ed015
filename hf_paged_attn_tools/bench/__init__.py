"""Benchmark: the paged engine, its ``model.generate`` routing, transformers' continuous batching
and padded ``generate`` on the same model and requests, against a forward-only bound.

Run ``python -m hf_paged_attn_tools.bench --help`` (or ``hf-paged-attn bench --help``).
"""

from hf_paged_attn_tools.bench.command import main, run

__all__ = ["main", "run"]
