"""Every use of torch's private API (``torch._dynamo``, ``torch._inductor``, ``torch._guards``,
``torch.ops.mkldnn``) in one module, as ``transformers_private.py`` holds transformers'.

These names change between torch releases without notice; here a torch upgrade breaks one file, whose
functions say what the package needs from each. ``tests/test_architecture.py`` keeps every other module of
the package off ``torch._*`` and ``torch.ops.mkldnn``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch._dynamo
import torch._dynamo.utils
import torch._inductor.config
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = [
    "CustomGraphPass",
    "compile_fx",
    "compile_settings",
    "detect_fake_mode",
    "get_hash_for_files",
    "graph_breaks",
    "inductor_cache_dir",
    "linear_pointwise",
    "mark_dynamic",
    "mkldnn_bf16_supported",
    "mkldnn_fp16_supported",
    "raise_recompile_limit",
    "reorder_linear_weight",
]


# --------------------------------------------------------------------------- dynamo and inductor


def inductor_cache_dir() -> str:
    """The directory of inductor's disk cache (``TORCHINDUCTOR_CACHE_DIR``, else a folder under the temp dir)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_disk_cache_on() -> bool:
    """Whether inductor reads and writes its disk cache of compiled graphs (on unless configured off)."""
    config = torch._inductor.config
    return bool(config.fx_graph_cache) and not config.force_disable_caches


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
    """Inductor's compiler, as ``torch.compile(backend="inductor")`` runs it (imported here: it is large, and
    eager engines never need it)."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, example_inputs)


def graph_breaks() -> int:
    """Dynamo's graph breaks in this process so far."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Dynamo treats ``tensor``'s size ``dim`` as dynamic where it can (no error where it specialises)."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


@contextlib.contextmanager
def compile_settings(inductor_options: dict[str, object]) -> Iterator[None]:
    """Inductor's ``inductor_options`` and dynamo's inlining of nested compile regions (``invoke_subgraph``)
    inside the block. Both configs are per thread (context variables)."""
    with torch._inductor.config.patch(inductor_options), torch._dynamo.config.patch(inline_invoke_subgraph=True):
        yield


def raise_recompile_limit(limit: int) -> Callable[[], None]:
    """Dynamo's graphs per code object at least ``limit``; returns the undo (a no-op if someone changed it since)."""
    config = torch._dynamo.config
    original = config.recompile_limit
    raised = config.recompile_limit = max(original, limit)

    def undo() -> None:
        if config.recompile_limit == raised:
            config.recompile_limit = original

    return undo


# --------------------------------------------------------------------------- oneDNN (mkldnn) ops


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN has a bf16 matmul on this CPU (AVX-512 BF16 / AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def mkldnn_fp16_supported() -> bool:
    """Whether oneDNN has a fp16 matmul on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def reorder_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [out, in] packed in oneDNN's blocked layout for matmuls of about ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``packed`` (``reorder_linear_weight``'s copy of ``weight``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
