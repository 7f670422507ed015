"""Which models this machine has compiled: so that ``PagedConfig(compile=None)`` compiles a model whose graphs
inductor holds in its disk cache at start-up, before the first request, rather than in the background.

A compile in the background shares the process with the steps it would speed up, and most of a cached compile
is Python (dynamo's trace, loading the cached graph) that holds the GIL every eager step needs: on the demo
model the three passes while it ran measured about a third of eager's throughput, where a compile at start-up
takes 4.9-6.4 s with the cache warm and every pass after it runs compiled (docs/performance.md). A cold compile
(30-120 s) still runs in the background, so that a short script never waits for it.

Each successful compile leaves an empty file named by a hash of what its graphs depend on (the model's config,
its dtype, the thread count, torch's, transformers' and this package's versions, inductor's cache directory) in
``$HF_PAGED_ATTN_CACHE/compiled/``; a record whose inductor cache directory is gone does not count.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path

import torch
import transformers

from ...kernels.cpu_native import cache_dir
from ...torch_private import inductor_cache_dir

logger = logging.getLogger(__name__)


@functools.cache
def _package_version() -> str:
    try:
        return importlib.metadata.version("hf-paged-attn")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "source"


def signature(model: torch.nn.Module, num_threads: int) -> str:
    """The hash of what ``model``'s compiled graphs depend on, for a compile at ``num_threads`` threads."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)  # where it was loaded from: the same model copied elsewhere has the same graphs
    parts = [
        json.dumps(config, sort_keys=True),
        str(model.dtype),
        str(num_threads),
        torch.__version__,
        transformers.__version__,
        _package_version(),
        inductor_cache_dir(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _path(model: torch.nn.Module, num_threads: int) -> Path:
    return cache_dir() / "compiled" / signature(model, num_threads)


def record(model: torch.nn.Module, num_threads: int) -> None:
    """Note that ``model`` compiled at ``num_threads`` threads (never raises: a read-only home loses the record)."""
    path = _path(model, num_threads)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as exc:
        logger.debug("hf_paged_attn: could not record the compile at %s: %s", path, exc)


def recorded(model: torch.nn.Module, num_threads: int | None = None) -> bool:
    """Whether ``model`` compiled on this machine before, with inductor's cache still in place (``num_threads``:
    torch's count by default, which the compile's graph takes: ``threads.candidates`` ends with it)."""
    num_threads = num_threads or torch.get_num_threads()
    return os.path.isdir(inductor_cache_dir()) and _path(model, num_threads).exists()
