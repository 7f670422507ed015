"""lora/kernels: the Triton LoRA kernels (``kernels/lora_triton.py``: ``lora_shrink``, ``lora_expand``) against
their float64 reference (``kernels/lora_reference.py``) on the device, each element within the rounding bound
of the kernels' arithmetic (``lora_shrink_bound`` / ``lora_expand_bound``), then the pair chained, in fp32,
bf16, fp16 and PEFT's float32 adapters under a bf16 base.

Shapes: a decode step (one row per request, 64 requests over 3 adapters and the base), a prefill step (1024
rows), a single row; Llama-8B-sized features (4096 in, 4096 and 14336 out), ranks 8, 16 and 64 padded to 64,
an adapter with no rows, a layer lacking an adapter (``lora_ids`` -1). ``--device cpu``: tiny shapes, the
interpreter, whose bfloat16 casts truncate (the bound takes one ulp for them there).

lora/engine-fp32: the engine's eager LoRA router on the kernels (``runtime/model/lora_kernels.py``, which it picks
on CUDA by itself; forced on the CPU), requests under two adapters (ranks 8 and 4, other target modules and
scalings) and the base in one batch, against PEFT on sdpa under each request's adapter, greedy, up to the first
near-tie. Needs peft.
"""

from __future__ import annotations

import time

import torch

from ..base import Check, Context, Fail, Skip, interpreting_triton
from ..helpers import TIE_TOLERANCE, compare_up_to_tie, load_model, patched, sdpa_greedy, seconds_since

DTYPES = {  # x, weights, y
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16, torch.float16),
    "bf16+fp32-lora": (torch.bfloat16, torch.float32, torch.bfloat16),
}
# (label, rows, in, out, ranks, slots, lora_ids or None, slot given no row)
CASES = (
    ("decode", 64, 4096, 4096, [8, 16, 64], 3, None, None),
    ("prefill", 1024, 4096, 14336, [16, 64], 3, [1, -1, 0], None),
    ("one-row", 1, 4096, 1024, [8], 1, None, None),
    ("empty-adapter", 300, 4096, 4096, [8, 16, 64], 3, None, 1),
)
TINY_CASES = (
    ("decode", 6, 64, 48, [4, 8], 2, None, None),
    ("prefill", 40, 96, 80, [8, 16], 3, [1, -1, 0], 2),
    ("one-row", 1, 32, 16, [8], 1, None, None),
)


def _cast_roundoff(dtype: torch.dtype) -> float:
    # the kernels' float32 -> dtype cast: to nearest on a GPU; the interpreter truncates to bfloat16 (one ulp)
    eps = torch.finfo(dtype).eps
    return eps if dtype == torch.bfloat16 and interpreting_triton() else eps / 2


def _case(case: tuple, dtypes: tuple[torch.dtype, ...], gen: torch.Generator, device: torch.device) -> dict:
    from hf_paged_attn.kernels import lora_triton

    _, rows, num_in, num_out, ranks, num_slots, lora_ids, empty = case
    x_dtype, w_dtype, y_dtype = dtypes
    a = lora_triton.stack_padded([torch.randn(r, num_in, generator=gen) / num_in**0.5 for r in ranks], 0, w_dtype)
    b = lora_triton.stack_padded([torch.randn(num_out, r, generator=gen) for r in ranks], 1, w_dtype)
    choices = torch.tensor([s for s in range(-1, num_slots) if s != empty])
    slots = choices[torch.randint(len(choices), (rows,), generator=gen)]  # [N], shuffled: segments are not runs
    token_lora = slots if lora_ids is None else torch.tensor([-1, *lora_ids])[slots + 1]  # [N]: stack index
    return dict(
        x=torch.randn(rows, num_in, generator=gen).to(x_dtype), y=torch.randn(rows, num_out, generator=gen).to(y_dtype),
        a=a, b=b, scalings=torch.rand(len(ranks), generator=gen) * 4, slots=slots, num_slots=num_slots,
        lora_ids=None if lora_ids is None else torch.tensor(lora_ids, dtype=torch.int32), token_lora=token_lora,
        device=device,
    )  # fmt: skip


def _ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    """The worst error as a fraction of its bound (a pass is <= 1)."""
    return float((err / bound).max()) if err.numel() else 0.0


def check_case(c: dict) -> tuple[float, float]:
    """(shrink, expand) worst error / bound on the device, each kernel fed the same inputs as its reference."""
    from hf_paged_attn.kernels import lora_reference as ref
    from hf_paged_attn.kernels import lora_triton

    dev = c["device"]
    on = {k: (None if c[k] is None else c[k].to(dev)) for k in ("x", "y", "a", "b", "scalings", "lora_ids")}
    segments = lora_triton.lora_segments(c["slots"].to(dev), c["num_slots"])
    t = lora_triton.lora_shrink(on["x"], on["a"], segments, on["lora_ids"]).cpu()
    want_t = ref.lora_shrink_reference(c["x"], c["a"], c["token_lora"])
    shrink = _ratio((t.double() - want_t).abs(), ref.lora_shrink_bound(c["x"], c["a"], c["token_lora"]) + 1e-300)
    # t rounded to B's dtype beforehand, so that the kernel's cast of it (PEFT's) is exact whichever rounding the
    # device makes (the interpreter truncates to bfloat16, torch rounds to nearest)
    t = t.to(c["b"].dtype).float()
    y = on["y"].clone()
    lora_triton.lora_expand(y, t.to(dev), on["b"], on["scalings"], segments, on["lora_ids"])
    want = ref.lora_expand_reference(c["y"], t, c["b"], c["scalings"], c["token_lora"])
    bound = ref.lora_expand_bound(c["y"], t, c["b"], c["scalings"], c["token_lora"], want, _cast_roundoff(y.dtype))
    expand = _ratio((y.cpu().double() - want).abs(), bound)
    if not torch.equal(y.cpu()[c["token_lora"] < 0], c["y"][c["token_lora"] < 0]):
        raise Fail("lora_expand wrote to a row without an adapter")
    return shrink, expand


def run(ctx: Context) -> str:
    if ctx.on_cuda and torch.cuda.get_device_capability(ctx.device) < (8, 0):
        raise Skip("the LoRA kernels run on compute capability 8.0+ (bf16 dots)")
    if not ctx.on_cuda and not interpreting_triton():
        raise Skip("no CUDA, and Triton is not interpreting (--device cpu sets TRITON_INTERPRET=1)")
    gen = torch.Generator().manual_seed(52)
    start, worst, ran = time.perf_counter(), (0.0, ""), 0
    failures = []
    for case in TINY_CASES if ctx.tiny else CASES:
        for name, dtypes in DTYPES.items():
            shrink, expand = check_case(_case(case, dtypes, gen, ctx.device))
            ran += 1
            for kernel, ratio in (("shrink", shrink), ("expand", expand)):
                label = f"{case[0]}/{name}/{kernel}"
                worst = max(worst, (ratio, label))
                if not ratio <= 1.0:
                    failures.append(f"{label} at {ratio:.2f}x its bound")
    elapsed = time.perf_counter() - start
    detail = f"{ran} cases, worst error {worst[0]:.2f}x its rounding bound ({worst[1]}), {elapsed:.1f}s"
    if failures:
        raise Fail(f"{len(failures)} over the bound, first: {failures[0]}; {detail}")
    return detail


ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=1),
    "b": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"], seed=2),
}


def _peft(directory: str, paths: dict[str, str], attn: str, device: torch.device) -> torch.nn.Module:
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_model(directory, attn, device, torch.float32), paths["a"], adapter_name="a")
    model.load_adapter(paths["b"], adapter_name="b")
    return model.to(device).eval()


def engine_parity(ctx: Context) -> str:
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        raise Skip(f"peft is not installed ({exc})") from exc
    if ctx.on_cuda and torch.cuda.get_device_capability(ctx.device) < (8, 0):
        raise Skip("the LoRA kernels run on compute capability 8.0+")
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn.kernels import lora_triton
    from hf_paged_attn.runtime.model import lora_kernels
    from hf_paged_attn_tools.testing import save_random_lora

    start = time.perf_counter()
    directory = ctx.tiny_llama()
    paths = {name: save_random_lora(directory, ctx.subdir(f"lora_{name}_"), **cfg) for name, cfg in ADAPTERS.items()}
    lens, new = ([3, 9, 17, 5, 12, 1], 8) if ctx.tiny else ([1, 5, 17, 33, 40, 64, 120, 250, 7, 90, 2, 300], 32)
    adapters = [("a", "b", None)[i % 3] for i in range(len(lens))]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 128, (n,), generator=gen).tolist() for n in lens]
    ref = _peft(directory, paths, "sdpa", ctx.device)
    references, changed = [], 0  # changed: requests whose adapter changes the base model's tokens
    for prompt, adapter in zip(prompts, adapters):
        with ref.disable_adapter():
            base = sdpa_greedy(ref, prompt, new)
        if adapter is not None:
            ref.set_adapter(adapter)
            references.append(sdpa_greedy(ref, prompt, new))
            changed += references[-1][0] != base[0]
        else:
            references.append(base)
    del ref
    if changed == 0:
        raise Fail("the random adapters change no request's tokens: parity would prove nothing")
    paged = _peft(directory, paths, "paged", ctx.device)
    calls = [0]
    expand = lora_triton.lora_expand

    def counted(*args: object, **kwargs: object) -> None:
        calls[0] += 1
        expand(*args, **kwargs)

    # on CUDA the router picks the kernels itself (use_triton); the CPU dry run forces them
    forced = (lambda device: True) if not ctx.on_cuda else lora_kernels.use_triton
    with patched(lora_kernels, "use_triton", forced), patched(lora_triton, "lora_expand", counted):
        with ContinuousBatchingEngine(paged, PagedConfig(block_size=16)) as engine:
            ids = engine.add_all([dict(input_ids=p, max_new_tokens=new, adapter_name=a)
                                  for p, a in zip(prompts, adapters)])  # fmt: skip
            rows = [out.output_ids for out in engine.collect(ids)]
    if calls[0] == 0:
        raise Fail("the router never ran the LoRA kernels (lora_kernels.use_triton is false here?)")
    tol = TIE_TOLERANCE[torch.float32]
    compared = sum(
        compare_up_to_tie(f"prompt {i} (len {len(p)}, adapter {a})", got, want, gaps, tol)
        for i, (p, a, got, (want, gaps)) in enumerate(zip(prompts, adapters, rows, references, strict=True))
    )
    return (f"{len(prompts)} requests over a, b and the base x {new} tokens ({changed} changed by their adapter), "
            f"{compared}/{len(prompts) * new} steps compared (tie tol {tol}), {calls[0]} kernel pairs, "
            f"{seconds_since(start)}")  # fmt: skip


USES = (
    "hf_paged_attn.kernels.lora_triton:lora_shrink(x, a_stack, segments, lora_ids)",
    "hf_paged_attn.kernels.lora_triton:lora_expand(y, t, b_stack, scalings, segments, lora_ids)",
    "hf_paged_attn.kernels.lora_triton:lora_segments(token_slot, num_slots)",
    "hf_paged_attn.kernels.lora_triton:stack_padded(weights, rank_dim, dtype)",
    "hf_paged_attn.kernels.lora_reference:lora_shrink_reference(x, a_stack, token_lora)",
    "hf_paged_attn.kernels.lora_reference:lora_expand_reference(y, t, b_stack, scalings, token_lora)",
    "hf_paged_attn.kernels.lora_reference:lora_shrink_bound(x, a_stack, token_lora)",
    "hf_paged_attn.kernels.lora_reference:lora_expand_bound(y, t, b_stack, scalings, token_lora, want, cast_roundoff)",
)
ENGINE_USES = (
    "hf_paged_attn:ContinuousBatchingEngine.add_all(requests)",
    "hf_paged_attn:ContinuousBatchingEngine.collect(ids)",
    "hf_paged_attn:PagedConfig(block_size)",
    "hf_paged_attn.runtime.model.lora_kernels:use_triton(device)",
    "hf_paged_attn.kernels.lora_triton:lora_expand",
    "hf_paged_attn_tools.testing:save_random_lora(base_directory, directory, seed)",
)
CHECKS = [
    Check("lora/kernels", run, 120, cpu=True, uses=USES),
    Check("lora/engine-fp32", engine_parity, 90, cpu=True, uses=ENGINE_USES),
]
