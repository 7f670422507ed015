"""Linear layers on oneDNN's prepacked weights, in the CPU's compiled forward (``compiled.py``).

torch's bf16 ``F.linear`` runs oneDNN's AMX matmul, but reorders the weight into the blocked layout
AMX reads at every call (``ONEDNN_VERBOSE=1`` shows it: 0.33 ms for 64 rows of a 512 x 1536
projection, 0.20 ms on a weight reordered once); its fp32 ``F.linear`` is MKL's sgemm, 2-3x slower than
oneDNN's packed one on AMD EPYCs. vLLM's CPU build reorders every weight once at load
(``ops.create_onednn_mm``); inductor does so only when it freezes the weights, which
``compiled.inductor_options`` does not (frozen graphs can't use inductor's disk cache). This module
does what vLLM does, without touching the model:

- ``pack(model)`` keeps a reordered copy of each weight of a packed dtype (``DTYPES``: bf16 where oneDNN
  has it, float32 except on Intel CPUs) of the layers ``fp32_matmuls.plain_linear`` takes
  (``torch_private.reorder_linear_weight``, for ``PACK_ROWS`` rows as vLLM's hint), kept by the weight's
  identity (a weak reference to the very tensor) with its ``weights.fingerprint``, shape and strides
  (``_PACKED``); a data pointer is no key: a replaced weight's new storage may reuse a freed address;
- ``hf_paged_attn::packed_linear(x, weight, bias)`` is an opaque op (inductor calls it as it calls
  ``aten::mm``) that multiplies by the packed copy, or runs ``F.linear`` whenever the weight is not the
  one packed (another tensor, an in-place update since, another dtype): never a stale result;
- ``RoutePackedLinears`` is a torch function mode that sends every ``F.linear`` on a CPU weight of a packed
  dtype there, entered inside the compiled forward (dynamo traces the mode away, so the graph calls the op
  directly) and, for float32 weights only (``EAGER_DTYPES``), around an engine's eager steps while its compile
  runs, once the compile has made the copies (``compiled.CompiledModel.packed``). Other eager forwards (the
  model's own, ``compile=False`` engines) never enter it and run as before. ``linear_groups`` then makes the
  graph's calls that share an input one matmul.

The copies take as much memory as the packed linear weights (as inductor's frozen weights do); they are
made only while they fit in a quarter of the memory available (``_fits``); ``PagedConfig(compile=False)``
makes none.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...torch_private import linear_pointwise, reorder_linear_weight
from ..model.weights import fingerprint, version_of
from .fp32_matmuls import ATTR as FP32_COPIES
from .fp32_matmuls import hardware_lacks, plain_linear

logger = logging.getLogger(__name__)

PACK_ROWS = 32  # the row count oneDNN chooses the packed layout for (vLLM's hint; any row count runs)


def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...; "" where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def packed_dtypes(vendor: str | None = None) -> tuple[torch.dtype, ...]:
    """The weight dtypes packed here: bf16 where oneDNN has a bf16 matmul (AVX-512 BF16, AMX); float32 too,
    except on Intel CPUs. On the AMD EPYCs of docs/performance.md oneDNN's packed sgemm was 2-3x faster than
    MKL's (what ``F.linear`` runs in float32: MKL does not take its best AVX-512 code there); on the Intel
    Xeons it was as fast or slower."""
    vendor = cpu_vendor() if vendor is None else vendor
    fp32 = () if vendor == "GenuineIntel" else (torch.float32,)
    return fp32 + (() if hardware_lacks(torch.bfloat16) else (torch.bfloat16,))


DTYPES = packed_dtypes()


@dataclass(frozen=True, slots=True)
class _Packed:
    """A weight's packed copy and the identity it was made from."""

    packed: torch.Tensor
    made_of: tuple[int, int]  # the weight's ``fingerprint`` (version counter, data pointer) when packed
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    source: weakref.ReferenceType[torch.Tensor]  # the very tensor packed


# id(weight) -> its packed copy. An id outlives nothing: every use checks ``source() is weight`` (a new
# tensor that took a freed weight's id is another tensor), and the entry goes with its weight (``_drop``).
_PACKED: dict[int, _Packed] = {}


def _drop(key: int, entry: _Packed) -> None:
    """Forgets ``entry`` when its weight is freed (unless a newer copy took its key)."""
    if _PACKED.get(key) is entry:
        del _PACKED[key]


def _holds(entry: _Packed | None, weight: torch.Tensor) -> bool:
    """Whether ``entry`` was packed from exactly ``weight``, unchanged since."""
    return (
        entry is not None
        and entry.source() is weight
        and entry.made_of == fingerprint((weight,))
        and entry.shape == tuple(weight.shape)
        and entry.stride == weight.stride()  # w.t() of a square weight shares its pointer and shape
        and entry.dtype == weight.dtype
    )


def _lookup(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s packed copy, if it is exactly the tensor packed and unchanged since. The compiled graph
    passes the packed tensor object itself at every call: that object at its packing's version and data
    pointer (``p.data = new`` keeps the object, moves the pointer) is checked first, with the fewest Python
    steps (between two matmuls the caches are cold, and every step counts: ~30 us a call for ``_holds``
    inside a decode step)."""
    entry = _PACKED.get(id(weight))
    if entry is not None and entry.source() is weight and entry.made_of == (version_of(weight), weight.data_ptr()):
        return entry.packed
    return entry.packed if _holds(entry, weight) else None


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on ``weight``'s packed copy when ``pack`` made one that still holds."""
    packed = _lookup(weight) if x.dtype == weight.dtype else None
    if packed is None or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    return linear_pointwise(x, packed, bias)


def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# A plain library op, not ``torch.library.custom_op``: its dispatch costs ~2 us a call against ~5 us,
# and a step calls it for every projection of every layer. It has no autograd formula: the compiled
# forward runs under inference mode.
_LIB = torch.library.Library("hf_paged_attn", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("hf_paged_attn::packed_linear", _packed_linear_fake, lib=_LIB)
packed_linear = torch.ops.hf_paged_attn.packed_linear.default


# The weights whose linears an engine's eager steps route to the packed copies while its compile runs. Eager
# passes alternating with and without the route in one process (``benchmarks/eager_route_ab.py``, 2 threads, an AMD
# EPYC): float32 1.10-1.11x on the 30M Llama (MKL's sgemm, what F.linear runs, is the slow one there), level within
# noise on the bundled model; bfloat16 0.84x and 0.88x (F.linear's own oneDNN path is faster in eager): float32 only.
EAGER_DTYPES = (torch.float32,)


class RoutePackedLinears(TorchFunctionMode):
    """Sends ``F.linear`` on a CPU weight of a packed dtype (``DTYPES``, and of ``dtypes`` when given) to
    ``packed_linear``: in a compiled forward, and in the eager steps while a compile runs (``EAGER_DTYPES``;
    there every torch call pays this Python hop, ~1 us)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
        super().__init__()
        self.dtypes = dtypes

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                weight.dtype in DTYPES and (self.dtypes is None or weight.dtype in self.dtypes)
                and weight.device.type == "cpu" and x.dtype == weight.dtype and weight.dim() == 2
            ):  # fmt: skip
                return packed_linear(x, weight, bias)
        return func(*args, **kwargs)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights to pack, each once: those of ``model``'s plain CPU linears of a packed dtype
    (``plain_linear``); for a layer that multiplies by float32 copies instead (``fp32_matmuls.install``, a
    CPU without bf16 matmuls), its float32 copy where float32 is packed (what frozen weights gave there)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        copies = module.__dict__.get(FP32_COPIES)
        if copies is not None:
            weight = copies.weight if torch.float32 in DTYPES else None
        else:
            weight = module.weight if plain_linear(module, DTYPES) else None
        if weight is not None and weight.dim() == 2:
            seen.setdefault(id(weight), weight)
    return list(seen.values())


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it can't be read)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _fits(weights: list[torch.Tensor]) -> bool:
    """Whether packed copies of ``weights`` fit in a quarter of the available memory."""
    need = sum(w.numel() * w.element_size() for w in weights)
    available = _available_bytes()
    return available is None or need <= available // 4


def wanted(model: nn.Module, freezing: bool) -> bool:
    """Whether the compiled forward of ``model`` should run its linears on packed weights: on the CPU,
    unfrozen weights (frozen ones inductor packs itself), and linears of a packed dtype (``DTYPES``)."""
    if freezing:
        return False
    return bool(_weights(model))


def pack(model: nn.Module) -> int:
    """Packs every linear weight of a packed dtype of ``model`` not packed yet (or changed since); returns how many
    copies it made. Nothing when they would not fit (``_fits``: logged). A copy is dropped with its weight."""
    weights = _weights(model)
    if not _fits(weights):
        logger.warning("hf_paged_attn: not packing the linear weights for oneDNN: the copies would take more than a "
                       "quarter of the available memory")  # fmt: skip
        return 0
    made = 0
    with torch.inference_mode():
        for w in weights:
            if _holds(_PACKED.get(id(w)), w):
                continue
            packed = reorder_linear_weight(w.detach(), PACK_ROWS)
            made_of, ref = fingerprint((w,)), weakref.ref(w)
            entry = _PACKED[id(w)] = _Packed(packed, made_of, tuple(w.shape), w.stride(), w.dtype, ref)
            weakref.finalize(w, _drop, id(w), entry)
            made += 1
    return made


def holds_copies(model: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether ``pack`` made copies of ``model``'s weights of ``dtypes`` that still hold."""
    return any(w.dtype in dtypes and _holds(_PACKED.get(id(w)), w) for w in _weights(model))


def unpack(model: nn.Module) -> int:
    """Drops the packed copies of ``model``'s weights (the op then runs ``F.linear`` on them); returns how many."""
    return sum(_PACKED.pop(id(w), None) is not None for w in _weights(model))
