"""kernels/<backend>/<dtype>: each backend's three entry points against the float64 reference
(``kernels/reference.py``) on the device: paged decode (Triton: split-K automatic and forced),
paged prefill, and ``write_kv`` followed by paged prefill, with GQA, a window + softcap, and sinks.

Block size 256 (flash-attn 2's minimum), 16 query heads over 4 KV heads, head_dim 128; lengths mix
short requests with ~2K-token ones so that split-K has tiles to split. ``--device cpu``: 4 heads
over 2 of 32, block size 16, contexts under 100 tokens (Triton through its interpreter).
"""

from __future__ import annotations

import functools
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..base import BACKEND_NAMES, Check, Context, Fail, Skip
from ..helpers import DTYPES, TOLERANCE, random_pages, short_error

if TYPE_CHECKING:
    from hf_paged_attn.kernels.base import AttentionBackend

Case = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # () -> (out, reference), both on the CPU


@dataclass(frozen=True)
class Setup:
    """One backend and dtype on one device, and the random source of every case's data."""

    backend: AttentionBackend
    name: str
    dtype: torch.dtype
    device: torch.device
    tiny: bool
    gen: torch.Generator
    shape: tuple[int, int, int, int]  # query heads, K/V heads, head dim, block size


def option_sets(num_heads: int, gen: torch.Generator) -> list[tuple[str, dict]]:
    return [
        ("plain", dict(causal=True, window_size=(-1, -1), softcap=0.0, sinks=None)),
        ("window+softcap", dict(causal=True, window_size=(100, 0), softcap=30.0, sinks=None)),
        ("sinks", dict(causal=True, window_size=(-1, -1), softcap=0.0, sinks=torch.randn(num_heads, generator=gen))),
    ]


def decode_cases(setup: Setup, opts: dict, label: str) -> Iterator[tuple[str, Case]]:
    from hf_paged_attn.kernels import reference
    from hf_paged_attn.kernels.base import AttentionOptions

    backend, dtype, device, gen = setup.backend, setup.dtype, setup.device, setup.gen
    h, h_kv, d, bs = setup.shape
    scale = d**-0.5
    dev_opts = {**opts, "sinks": None if opts["sinks"] is None else opts["sinks"].to(device)}
    lens = [0, 5, 15, 16, 40, 90] if setup.tiny else [0, 37, 255, 256, 1000, 2047]
    k_cache, v_cache, table = random_pages([n + 1 for n in lens], bs, h_kv, d, dtype, gen, device)
    q = torch.randn(len(lens), 1, h, d, generator=gen).to(dtype)
    k_new = torch.randn(len(lens), 1, h_kv, d, generator=gen).to(dtype)
    v_new = torch.randn(len(lens), 1, h_kv, d, generator=gen).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    # The protocol's entry point picks split-K itself; forcing a count is triton_ops' own keyword.
    splits_choices = (None, 4) if setup.name == "triton" else (None,)
    for splits in splits_choices:

        def run(splits: int | None = splits) -> tuple[torch.Tensor, torch.Tensor]:
            kc, vc = k_cache.clone(), v_cache.clone()
            args = (q.to(device), kc, vc, k_new.to(device), v_new.to(device), seqlens.to(device), table)
            if splits is None:
                out = backend.paged_decode_attention(*args, options=AttentionOptions(softmax_scale=scale, **dev_opts))
            else:
                from hf_paged_attn.kernels import triton_ops

                out = triton_ops.paged_decode_attention(*args,
                                                        options=AttentionOptions(softmax_scale=scale, **dev_opts),
                                                        num_splits=splits)
            kc, vc, tab = kc.cpu(), vc.cpu(), table.cpu()
            ref = torch.empty_like(q)
            for b, n in enumerate(lens):
                keys = reference.gather_pages(kc, tab[b], n + 1)
                if not torch.equal(keys[-1], k_new[b, 0]):
                    raise Fail(f"decode did not append request {b}'s token at {n}")
                values = reference.gather_pages(vc, tab[b], n + 1)
                ref[b] = reference.attend_one(q[b], keys, values, options=AttentionOptions(softmax_scale=scale, **opts))
            return out.cpu(), ref

        yield f"decode[{label}, splits={splits or 'auto'}]", run


def prefill_cases(setup: Setup, opts: dict, label: str) -> Iterator[tuple[str, Case]]:
    """Paged prefill, twice: over pages that already hold every key, and after ``write_kv`` wrote the
    step's own keys into them (what the cache does on every prefill step). The second replaces the
    old ``varlen[...]`` cases: no backend has a varlen entry point since the gather path was removed."""
    from hf_paged_attn.kernels import reference
    from hf_paged_attn.kernels.base import AttentionOptions

    backend, dtype, device, gen = setup.backend, setup.dtype, setup.device, setup.gen
    h, h_kv, d, bs = setup.shape
    scale = d**-0.5
    dev_opts = {**opts, "sinks": None if opts["sinks"] is None else opts["sinks"].to(device)}
    q_lens, prefix = (
        ([1, 7, 20, 0, 33], [0, 20, 50, 3, 0]) if setup.tiny else ([1, 77, 300, 0, 513], [0, 200, 1500, 10, 0])
    )
    k_lens = [p + n for p, n in zip(prefix, q_lens, strict=True)]
    k_cache, v_cache, table = random_pages(k_lens, bs, h_kv, d, dtype, gen, device)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(int(cu_q[-1]), h, d, generator=gen).to(dtype)  # [total_q, H, D]
    tab = table.cpu()
    k_packed = torch.cat([reference.gather_pages(k_cache.cpu(), tab[b], n) for b, n in enumerate(k_lens)])
    v_packed = torch.cat([reference.gather_pages(v_cache.cpu(), tab[b], n) for b, n in enumerate(k_lens)])
    # The step's new tokens are the last q_lens[b] keys of request b: their flat slots in the pages.
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))  # [total_q]
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, q_lens, strict=True)])
    slots = tab[rows, positions // bs].long() * bs + positions % bs  # [total_q]
    new_k, new_v = k_packed[_new_rows(cu_k, q_lens)], v_packed[_new_rows(cu_k, q_lens)]  # [total_q, H_kv, D]

    def reference_out() -> torch.Tensor:
        options = AttentionOptions(softmax_scale=scale, **opts)
        return reference.varlen_reference(qp, k_packed, v_packed, cu_q, cu_k, options=options)

    def prefill(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return backend.paged_prefill_attention(
            qp.to(device), kc, vc, cu_q.to(device), torch.tensor(k_lens, dtype=torch.int32, device=device), table,
            max(q_lens), max(k_lens), options=AttentionOptions(softmax_scale=scale, **dev_opts),
        )  # fmt: skip

    def from_pages() -> tuple[torch.Tensor, torch.Tensor]:
        return prefill(k_cache, v_cache).cpu(), reference_out()

    def written_then_read() -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = k_cache.clone(), v_cache.clone()
        flat_k, flat_v = kc.view(-1, h_kv, d), vc.view(-1, h_kv, d)  # [num_slots, H_kv, D]
        flat_k[slots.to(device)] = 0  # the step's slots hold garbage until write_kv fills them
        flat_v[slots.to(device)] = 0
        backend.write_kv(new_k.to(device), new_v.to(device), kc, vc, slots.to(device))
        if not (torch.equal(kc.cpu(), k_cache.cpu()) and torch.equal(vc.cpu(), v_cache.cpu())):
            raise Fail("write_kv did not write the step's keys into their slots")
        return prefill(kc, vc).cpu(), reference_out()

    yield f"paged_prefill[{label}]", from_pages
    yield f"write_kv+paged_prefill[{label}]", written_then_read


def _new_rows(cu_k: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    """Rows of the packed keys that are each request's last q_lens[b] (this step's) keys."""
    return torch.cat([torch.arange(int(cu_k[b + 1]) - n, int(cu_k[b + 1])) for b, n in enumerate(q_lens)]).long()


def kernel_cases(
    backend: AttentionBackend, name: str, dtype: torch.dtype, device: torch.device, tiny: bool
) -> Iterator[tuple[str, Case]]:
    shape = (4, 2, 32, 16) if tiny else (16, 4, 128, 256)
    setup = Setup(backend, name, dtype, device, tiny, torch.Generator().manual_seed(0), shape)
    for label, opts in option_sets(shape[0], setup.gen):
        yield from decode_cases(setup, opts, label)
        yield from prefill_cases(setup, opts, label)


def run(ctx: Context, name: str, dtype_name: str) -> str:
    backend = ctx.backend(name)
    dtype = DTYPES[dtype_name]
    tol = TOLERANCE[dtype]
    worst, worst_case, ran, unsupported, errors = 0.0, "", 0, [], []
    start = time.perf_counter()
    for case, fn in kernel_cases(backend, name, dtype, ctx.device, ctx.tiny):
        try:
            out, ref = fn()
        except NotImplementedError as exc:  # e.g. flash-attn: no sinks, no fp32
            unsupported.append(f"{case} ({exc})")
            continue
        except Exception as exc:
            errors.append(f"{case}: {short_error(exc)}")
            if len(errors) == 1:  # the first one whole: a compile error's text is long
                print(f"--- kernels/{name}/{dtype_name} {case}:", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
            continue
        ran += 1
        err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
        if not math.isfinite(err) or err > worst:
            worst, worst_case = err, case
    elapsed = time.perf_counter() - start
    if ran == 0 and not errors:
        raise Skip(f"every case unsupported: {unsupported[0] if unsupported else 'none ran'}")
    detail = f"{ran} cases, max abs err {worst:.2e} (tol {tol:.0e}, worst {worst_case or '-'}), {elapsed:.1f}s"
    if unsupported:
        detail += f"; {len(unsupported)} unsupported, e.g. {unsupported[0]}"
    if errors:
        raise Fail(f"{len(errors)} errors, first: {errors[0]}; {detail}")
    if not (worst <= tol):
        raise Fail(detail)
    return detail


USES = (
    "hf_paged_attn.kernels.base:AttentionBackend.write_kv(k, v, k_cache, v_cache, slot_mapping)",
    "hf_paged_attn.kernels.base:AttentionBackend.paged_decode_attention"
    "(q, k_cache, v_cache, k, v, cache_seqlens, block_table, options)",
    "hf_paged_attn.kernels.base:AttentionBackend.paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, "
    "seqused_k, block_table, max_seqlen_q, max_seqlen_k, options)",
    "hf_paged_attn.kernels.base:AttentionOptions(softmax_scale, causal, window_size, softcap, sinks)",
    "hf_paged_attn.kernels.triton_ops:paged_decode_attention(options, num_splits)",
    "hf_paged_attn.kernels.reference:attend_one(q, k, v, options)",
    "hf_paged_attn.kernels.reference:varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, options)",
    "hf_paged_attn.kernels.reference:gather_pages(cache, block_table_row, length)",
    "hf_paged_attn_tools.testing:shuffled_block_table(lens, block_size, gen, spare)",
)
# Triton's fp32 cases compile a dozen kernels first (~50 s on the H200's first run).
BUDGETS = {"triton": {"fp32": 150, "bf16": 90}, "flash": {"fp32": 60, "bf16": 60}, "torch": {"fp32": 60, "bf16": 60}}
CHECKS = [
    Check(
        f"kernels/{name}/{dtype}",
        functools.partial(run, name=name, dtype_name=dtype),
        BUDGETS[name][dtype],
        cpu=True,
        uses=USES,
    )  # fmt: skip
    for name in BACKEND_NAMES
    for dtype in ("fp32", "bf16")
]
