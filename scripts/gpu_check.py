"""One prepared GPU check (about 5 minutes on one H100/H200 before checks (h) and (i), whose time is
not yet measured; no network). Prints one line per check:

    [PASS|FAIL|SKIPPED] <check>: <details>

(a) kernels/<backend>/<dtype>: triton, flash (when importable) and torch backends against the
    float64 reference on CUDA: paged decode (split-K forced and automatic), paged prefill and
    varlen, with GQA, windows, softcap and sinks.
(b) greedy/<dtype>/<kernel>: a tiny random Llama, ``attn_implementation="paged"`` with
    ``PagedConfig(kernel=...)`` against ``"sdpa"``, 32 greedy tokens per prompt through the public API.
(c) bandwidth/<backend>: paged decode microbenchmark, K/V bytes read per second as a fraction of
    the device's peak memory bandwidth, kernel-only (calls replayed from a CUDA graph), then the time
    of one call with its host launches (what runs before 2026-12 printed alone).
(d) cascade/fp32: requests decoding together over a shared 96-token prefix take the torch
    backend's cascade path on CUDA and match sdpa token for token.
(e) splitk/bf16: the Triton decode kernel's kernel-only bandwidth against the number of split-K
    partitions, at block_size 256 and 16, and by launch knobs (figures only, to tune
    ``_choose_num_splits`` and ``_DECODE_BLOCK_N`` / warps / stages).
(f) throughput/bf16: the benchmark's ``uniform`` workload (64 requests, 30M-parameter Llama) on the
    GPU: the engine with each kernel against transformers' padded ``generate`` and continuous batching.
(g) mixed/offload, mixed/split: the tiny Llama with half its layers on ``cuda:0`` and half on the
    CPU, sdpa and paged under the same map. ``offload``: ``from_pretrained(device_map=...)``, where
    accelerate runs the CPU half on the GPU and streams its weights in; ``split``:
    ``dispatch_model(..., main_device="cpu")``, where the CPU half runs on the CPU, so pages live on
    both devices and each step's metadata is copied to the CPU once.
(h) graphs/fp32, graphs/bf16: CUDA graphs of decode steps: greedy parity with ``cuda_graphs=True``
    (Triton; buckets captured once and replayed), and the ``uniform`` workload with graphs off vs on.
(i) e2e/bf16, e2e/fp32-parity: a ~0.5B-parameter random Qwen2 (Qwen2.5-0.5B's shapes) in bf16, the
    engine against transformers' continuous batching with its CUDA graphs, and a decode step against
    the forward-only time; then the same architecture with 2 layers in fp32, paged (prefill straight
    from the pages) against sdpa, token for token.
(h) e2e/bf16: a ~0.5B-parameter random-weight Qwen2-shaped model (Qwen2.5-0.5B's sizes), 64 prompts
    of 64-512 tokens x 128 greedy tokens: the engine (best kernel) against transformers' continuous
    batching with CUDA graphs on, new tokens/s of each and the ratio (goal >= 2x); and one engine
    decode step of all 64 against transformers' sdpa forward of the same batch (goal <= 1.3x), each
    framed by torch.cuda.synchronize. Goals unmet are stated on the PASS line; FAIL means an error.
    e2e/fp32-parity: the same architecture with 2 layers, paged (triton; flash in bf16 when
    importable) against sdpa, greedy, through prefix hits, chunked prefill and mixed steps, every
    prefill read straight from the pages (no gather). ``--tiny`` dry-runs both on a tiny model on
    the CPU (Triton through its interpreter), so their code runs before a GPU ever sees it.

Checks run in ``CHECKS`` order (parity first, figures after), not in the order above. Without
CUDA every check prints SKIPPED and the script exits 0. Otherwise it exits 1 if a check failed;
at the time limit (SIGTERM from ``timeout``) the running check FAILs and the rest print SKIPPED.
Run it through ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable

import torch

# Run order: parity checks first, newest code first among them (a run cut short by its time limit
# still says whether the code is right), then the figures-only measurements, longest last.
CHECKS = (
    "kernels/triton/fp32",
    "kernels/triton/bf16",
    "kernels/flash/fp32",
    "kernels/flash/bf16",
    "kernels/torch/fp32",
    "kernels/torch/bf16",
    "greedy/fp32/torch",
    "greedy/fp32/triton",
    "greedy/bf16/torch",
    "greedy/bf16/triton",
    "greedy/bf16/flash",
    "graphs/fp32",
    "e2e/fp32-parity",
    "cascade/fp32",
    "mixed/offload",
    "mixed/split",
    "bandwidth/triton",
    "bandwidth/flash",
    "bandwidth/torch",
    "splitk/bf16",
    "graphs/bf16",
    "e2e/bf16",
    "throughput/bf16",
)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max abs error vs the float64 reference
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Peak HBM bandwidth by device-name substring, most specific first (bytes/s, vendor figures).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
)

failures: list[str] = []


def report(status: str, check: str, detail: str) -> None:
    if status == "FAIL":
        failures.append(check)
    print(f"[{status}] {check}: {detail}", flush=True)


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) < 300 else text[:297] + "..."


# ----------------------------------------------------------------------------------------------
# (a) kernel parity
# ----------------------------------------------------------------------------------------------


def load_backends() -> dict[str, object]:
    """name -> backend module, or the reason it is unavailable (a string)."""
    out: dict[str, object] = {}
    for name in ("triton", "flash", "torch"):
        try:
            module = importlib.import_module(f"hf_paged_attn.kernels.{name}_backend")
            if name == "flash":
                module._load_flash_attn()  # the adapter imports flash_attn lazily: try it now
            out[name] = module
        except Exception as exc:  # report whatever made it unavailable
            out[name] = short_error(exc)
    return out


def make_pages(lens: list[int], block_size: int, h_kv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """Random CUDA pages for lens[b] tokens under a shuffled block table (-1 past each request)."""
    from hf_paged_attn_tools.testing import shuffled_block_table

    table, num_blocks = shuffled_block_table(lens, block_size, gen, spare=2)
    shape = (num_blocks, block_size, h_kv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k_cache.cuda(), v_cache.cuda(), table.cuda()


def option_sets(num_heads: int, gen: torch.Generator) -> list[tuple[str, dict]]:
    return [
        ("plain", dict(causal=True, window_size=(-1, -1), softcap=0.0, sinks=None)),
        ("window+softcap", dict(causal=True, window_size=(100, 0), softcap=30.0, sinks=None)),
        ("sinks", dict(causal=True, window_size=(-1, -1), softcap=0.0, sinks=torch.randn(num_heads, generator=gen))),
    ]


def kernel_cases(backend, dtype: torch.dtype, seed: int = 0):
    """Yield (case name, function returning (out, ref)) for one backend and dtype.

    Block size 256 (flash-attn 2's minimum), 16 query heads over 4 KV heads, head_dim 128; lengths
    mix short requests with ~2K-token ones so that split-K has tiles to split.
    """
    from hf_paged_attn.kernels import reference

    gen = torch.Generator().manual_seed(seed)
    h, h_kv, d, bs = 16, 4, 128, 256
    scale = d**-0.5
    for opt_name, opts in option_sets(h, gen):
        cuda_opts = {**opts, "sinks": None if opts["sinks"] is None else opts["sinks"].cuda()}

        lens = [0, 37, 255, 256, 1000, 2047]
        k_cache, v_cache, table = make_pages([n + 1 for n in lens], bs, h_kv, d, dtype, gen)
        q = torch.randn(len(lens), 1, h, d, generator=gen).to(dtype).cuda()
        k_new = torch.randn(len(lens), 1, h_kv, d, generator=gen).to(dtype).cuda()
        v_new = torch.randn(len(lens), 1, h_kv, d, generator=gen).to(dtype).cuda()
        seqlens = torch.tensor(lens, dtype=torch.int32).cuda()

        for splits in (None, 4) if getattr(backend, "__name__", "").endswith("triton_backend") else (None,):

            def decode(splits=splits, k_cache=k_cache, v_cache=v_cache, lens=lens, table=table, q=q,
                       k_new=k_new, v_new=v_new, seqlens=seqlens, opts=opts, cuda_opts=cuda_opts):  # fmt: skip
                kc, vc = k_cache.clone(), v_cache.clone()
                extra = {} if splits is None else {"num_splits": splits}
                out = backend.paged_decode_attention(
                    q, kc, vc, k_new, v_new, seqlens, table, softmax_scale=scale, **cuda_opts, **extra
                )
                kc, vc, tab, qc = kc.cpu(), vc.cpu(), table.cpu(), q.cpu()
                ref = torch.empty_like(qc)
                for b, n in enumerate(lens):
                    keys = reference.gather_pages(kc, tab[b], n + 1)
                    if not torch.equal(keys[-1], k_new[b, 0].cpu()):
                        raise AssertionError(f"decode did not append request {b}'s token at {n}")
                    ref[b] = reference.attend_one(
                        qc[b], keys, reference.gather_pages(vc, tab[b], n + 1), softmax_scale=scale, **opts
                    )
                return out.cpu(), ref

            yield f"decode[{opt_name}, splits={splits or 'auto'}]", decode

        q_lens, prefix = [1, 77, 300, 0, 513], [0, 200, 1500, 10, 0]
        k_lens = [p + n for p, n in zip(prefix, q_lens, strict=True)]
        k_cache, v_cache, table = make_pages(k_lens, bs, h_kv, d, dtype, gen)
        cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
        qp = torch.randn(int(cu_q[-1]), h, d, generator=gen).to(dtype)
        # Pack the request's pages into [total_k, H_kv, D] for the varlen entry point and the reference.
        k_packed = torch.cat([reference.gather_pages(k_cache.cpu(), table.cpu()[b], n) for b, n in enumerate(k_lens)])
        v_packed = torch.cat([reference.gather_pages(v_cache.cpu(), table.cpu()[b], n) for b, n in enumerate(k_lens)])

        def ref_prefill(qp=qp, k_packed=k_packed, v_packed=v_packed, cu_q=cu_q, cu_k=cu_k, opts=opts):
            return reference.varlen_reference(qp, k_packed, v_packed, cu_q, cu_k, softmax_scale=scale, **opts)

        if hasattr(backend, "paged_prefill_attention"):

            def prefill(qp=qp, k_cache=k_cache, v_cache=v_cache, cu_q=cu_q, k_lens=k_lens, table=table,
                        q_lens=q_lens, cuda_opts=cuda_opts, ref_prefill=ref_prefill):  # fmt: skip
                out = backend.paged_prefill_attention(
                    qp.cuda(), k_cache, v_cache, cu_q.cuda(), torch.tensor(k_lens, dtype=torch.int32).cuda(),
                    table, max(q_lens), softmax_scale=scale, **cuda_opts,
                )  # fmt: skip
                return out.cpu(), ref_prefill()

            yield f"paged_prefill[{opt_name}]", prefill

        def varlen(qp=qp, k_packed=k_packed, v_packed=v_packed, cu_q=cu_q, cu_k=cu_k, q_lens=q_lens,
                   k_lens=k_lens, cuda_opts=cuda_opts, ref_prefill=ref_prefill):  # fmt: skip
            out = backend.varlen_attention(
                qp.cuda(), k_packed.cuda(), v_packed.cuda(), cu_q.cuda(), cu_k.cuda(), max(q_lens), max(k_lens),
                softmax_scale=scale, **cuda_opts,
            )  # fmt: skip
            return out.cpu(), ref_prefill()

        yield f"varlen[{opt_name}]", varlen


def check_kernels(backends: dict[str, object], name: str, dtype_name: str) -> None:
    check = f"kernels/{name}/{dtype_name}"
    backend = backends[name]
    if isinstance(backend, str):
        report("SKIPPED", check, f"backend unavailable ({backend})")
        return
    dtype = DTYPE_NAMES[dtype_name]
    tol = TOLERANCE[dtype]
    worst, worst_case, ran, unsupported, errors = 0.0, "", 0, [], []
    start = time.perf_counter()
    for case, run in kernel_cases(backend, dtype):
        try:
            out, ref = run()
        except NotImplementedError as exc:  # e.g. flash-attn: no sinks, no fp32
            unsupported.append(f"{case} ({exc})")
            continue
        except Exception as exc:
            errors.append(f"{case}: {short_error(exc)}")
            if len(errors) == 1:  # the first one whole: a compile error's text is long
                print(f"--- {check} {case}:", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
            continue
        ran += 1
        err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
        if not math.isfinite(err) or err > worst:
            worst, worst_case = err, case
    elapsed = time.perf_counter() - start
    if ran == 0 and not errors:
        report("SKIPPED", check, f"every case unsupported: {unsupported[0] if unsupported else 'none ran'}")
        return
    detail = f"{ran} cases, max abs err {worst:.2e} (tol {tol:.0e}, worst {worst_case or '-'}), {elapsed:.1f}s"
    if unsupported:
        detail += f"; {len(unsupported)} unsupported, e.g. {unsupported[0]}"
    if errors:
        report("FAIL", check, f"{len(errors)} errors, first: {errors[0]}; {detail}")
    elif not (worst <= tol):
        report("FAIL", check, detail)
    else:
        report("PASS", check, detail)


# ----------------------------------------------------------------------------------------------
# (b) greedy parity of a tiny random Llama
# ----------------------------------------------------------------------------------------------

# Tolerance rule: the paged model's greedy tokens must equal the sdpa reference's up to the first
# step where the reference's top-2 logits are within TIE_TOLERANCE of each other. There two correct
# implementations may pick different tokens through rounding alone (bf16 logits carry ~3 significant
# digits), and every later token depends on that pick, so the comparison stops there. A mismatch
# before such a near-tie is a FAIL. The line reports how many steps were compared, so a pass that
# compared little is visible. (The same rule as vLLM's check_logprobs_close, in spirit.)
TIE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.05}
NEW_TOKENS = 32


def tiny_llama_dir() -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024,
        # The default init (0.02) keeps the top-2 logit gaps ~10x the bf16 noise (median gap ~0.13 vs
        # <= 0.011 between bf16 and fp32 logits, measured on CPU); wider inits amplify the noise
        # faster than the gaps. A small vocabulary widens the gaps (fewer near-ties to stop at).
        initializer_range=0.02,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    directory = tempfile.mkdtemp(prefix="gpu_check_llama_")
    model.save_pretrained(directory)
    return directory


def greedy_parity(directory: str, dtype: torch.dtype, kernel: str, device: str = "cuda") -> str:
    """Compare the paged model with ``kernel`` against sdpa; returns the detail line, raises
    AssertionError on a mismatch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_paged_attn import PagedConfig
    from hf_paged_attn_tools.testing import left_padded

    vocab = AutoConfig.from_pretrained(directory).vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt_lens = [1, 5, 17, 33, 40, 64, 120, 250]
    prompts = [torch.randint(2, vocab, (n,), generator=gen) for n in prompt_lens]

    # Reference: each prompt alone (no padding), with the raw logits of every step.
    ref_model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa", dtype=dtype)
    ref_model = ref_model.to(device).eval()
    ref_tokens, ref_gaps = [], []
    for p in prompts:
        out = ref_model.generate(
            input_ids=p[None].to(device), attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
            max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        ref_tokens.append(out.sequences[0, len(p) :].cpu())
        top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values  # [steps, 2]
        ref_gaps.append((top2[:, 0] - top2[:, 1]).cpu())
    del ref_model

    # Candidate: the public API on one left-padded batch, as a user would call it.
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged", dtype=dtype)
    model = model.to(device).eval()
    width = max(prompt_lens)
    input_ids, attention_mask = left_padded([p.tolist() for p in prompts])
    batch = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    # Block size 256: flash-attn's paged decode needs a multiple of 256; the others take any.
    paged_config = PagedConfig(kernel=kernel, block_size=256 if kernel == "flash" else 16)
    out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, paged_config=paged_config)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    new = sequences[:, width:].cpu()  # [B, NEW_TOKENS]

    tol = TIE_TOLERANCE[dtype]
    compared, total = 0, 0
    for i, (want, gaps) in enumerate(zip(ref_tokens, ref_gaps, strict=True)):
        got = new[i, : len(want)]
        ties = (gaps < tol).nonzero()
        limit = int(ties[0]) if len(ties) else len(want)  # steps before the first near-tie must match
        mismatch = (got[:limit] != want[:limit]).nonzero()
        if len(mismatch):
            step = int(mismatch[0])
            raise AssertionError(
                f"prompt {i} (len {prompt_lens[i]}): token {step} is {int(got[step])}, sdpa gives "
                f"{int(want[step])} with a top-2 gap of {float(gaps[step]):.3g} (> tie tolerance {tol})"
            )
        compared += limit
        total += len(want)
    return f"{len(prompts)} prompts x {NEW_TOKENS} tokens, {compared}/{total} steps compared (tie tol {tol})"


def check_greedy(dtype_name: str, kernel: str, directory: str | None, backends: dict[str, object]) -> None:
    check = f"greedy/{dtype_name}/{kernel}"
    if isinstance(backends[kernel], str):
        report("SKIPPED", check, f"backend unavailable ({backends[kernel]})")
        return
    try:
        import hf_paged_attn  # noqa: F401 - registers attn_implementation="paged"

        if directory is None:
            raise RuntimeError("the tiny model could not be built (see above)")
        start = time.perf_counter()
        detail = greedy_parity(directory, DTYPE_NAMES[dtype_name], kernel)
        report("PASS", check, f"{detail}, {time.perf_counter() - start:.1f}s")
    except Exception as exc:  # the engine is young: report, never crash the script
        report("FAIL", check, short_error(exc))
        traceback.print_exc(file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# (c) decode bandwidth
# ----------------------------------------------------------------------------------------------


def peak_bandwidth(name: str) -> float | None:
    for key, peak in PEAK_BANDWIDTH:
        if key.lower() in name.lower():
            return peak
    return None


def time_cuda(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


KERNEL_CALLS = 50  # calls per timed CUDA graph (or per queued burst)


def time_kernel(
    fn: Callable[[], object], graph: bool = True, calls: int = KERNEL_CALLS, reps: int = 5
) -> tuple[float, str]:
    """(seconds per call of ``fn``'s device work without host launch overhead, how it was timed).

    ``time_cuda`` times one call between two events: on an idle GPU the end event waits for the host
    to launch every kernel, so for a 30 us kernel it mostly measures Python and launch latency. Here
    ``calls`` calls are captured in one CUDA graph and the median replay over ``reps`` is divided by
    ``calls``. ``graph=False`` (a backend that syncs with the host, which a graph cannot hold) queues
    the calls back to back instead: a lower bound on throughput only if the host keeps ahead.
    """
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graphs recommends
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for _ in range(calls):
                fn()
        run, how = cuda_graph.replay, f"a graph of {calls} calls"
    else:

        def run() -> None:
            for _ in range(calls):
                fn()

        how = f"{calls} queued calls"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2], how


def decode_problem(batch: int, ctx: int, block_size: int, h_kv: int, group: int, d: int):
    """bf16 pages holding ``ctx`` tokens per request under a shuffled block table, a query per request,
    and the K/V bytes one decode call reads."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = batch * ctx // block_size
    k_cache = torch.randn(blocks, block_size, h_kv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks, device="cuda").int().view(batch, ctx // block_size)  # shuffled pages
    q = torch.randn(batch, 1, h_kv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")  # k/v None: no append
    moved = 2 * batch * ctx * h_kv * d * k_cache.element_size()  # K and V bytes read
    return q, k_cache, v_cache, seqlens, table, moved


def check_bandwidth(backends: dict[str, object], name: str) -> None:
    """Kernel-only time (CUDA graph replay) and bandwidth, then the per-call time as ``time_cuda``
    measures it (host launches included, the figure earlier runs printed)."""
    from hf_paged_attn.kernels import BACKENDS

    check = f"bandwidth/{name}"
    backend = backends[name]
    if isinstance(backend, str):
        report("SKIPPED", check, f"backend unavailable ({backend})")
        return
    device_name = torch.cuda.get_device_name()
    peak = peak_bandwidth(device_name)
    h_kv, group, d, bs = 8, 4, 128, 256
    parts = []
    how = ""
    try:
        # A large batch (bandwidth bound across requests) and one long request (split-K's case).
        for batch, ctx in ((64, 4096), (1, 32768)):
            q, k_cache, v_cache, seqlens, table, moved = decode_problem(batch, ctx, bs, h_kv, group, d)

            def step(q=q, k_cache=k_cache, v_cache=v_cache, seqlens=seqlens, table=table):
                return backend.paged_decode_attention(
                    q, k_cache, v_cache, None, None, seqlens, table, softmax_scale=d**-0.5
                )

            seconds, how = time_kernel(step, graph=BACKENDS[name].graph_safe)
            per_call = time_cuda(step)
            rate = moved / seconds
            share = f" = {rate / peak:.0%} of {peak / 1e12:.2f} TB/s" if peak else ""
            parts.append(
                f"B={batch} ctx={ctx}: {seconds * 1e3:.3f} ms, {rate / 1e12:.2f} TB/s{share}; "
                f"per call {per_call * 1e3:.3f} ms, {moved / per_call / 1e12:.2f} TB/s"
            )
            del q, k_cache, v_cache, seqlens, table, step
            torch.cuda.empty_cache()
    except Exception as exc:
        report("FAIL", check, short_error(exc) + (f" (after: {'; '.join(parts)})" if parts else ""))
        traceback.print_exc(file=sys.stderr)
        return
    where = device_name if peak else f"{device_name}, peak unknown: absolute only"
    head = f"bf16 H_kv={h_kv} group={group} D={d} block={bs} on {where}, kernel time from {how}"
    report("PASS", check, head + "; " + "; ".join(parts))


# ----------------------------------------------------------------------------------------------
# (d) cascade decode over shared prefix blocks, (e) split-K sweep
# ----------------------------------------------------------------------------------------------


def check_cascade(directory: str | None) -> None:
    check = "cascade/fp32"
    try:
        from transformers import AutoModelForCausalLM

        from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
        from hf_paged_attn.kernels.torch_backend import decode as torch_decode

        if directory is None:
            raise RuntimeError("the tiny model could not be built (see above)")
        calls = []
        cascade = torch_decode._decode_cascade
        torch_decode._decode_cascade = lambda *a, **k: calls.append(1) or cascade(*a, **k)
        try:
            ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").cuda().eval()
            paged = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged").cuda().eval()
            gen = torch.Generator().manual_seed(3)
            prefix = torch.randint(2, ref.config.vocab_size, (96,), generator=gen).tolist()
            prompts = [
                prefix + torch.randint(2, ref.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)
            ]
            engine = ContinuousBatchingEngine(paged, PagedConfig(kernel="torch", num_blocks=256))
            engine.generate([prefix + [1]], max_new_tokens=2)  # caches the prefix blocks
            outs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        finally:
            torch_decode._decode_cascade = cascade
        if not calls:
            raise AssertionError("the cascade path never ran")
        compared = 0
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            ids = torch.tensor([p]).cuda()
            res = ref.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
            want = res.sequences[0, len(p) :].tolist()
            top2 = torch.stack(res.logits)[:, 0].float().topk(2, dim=-1).values  # [steps, 2]
            ties = ((top2[:, 0] - top2[:, 1]) < TIE_TOLERANCE[torch.float32]).nonzero()
            limit = int(ties[0]) if len(ties) else len(want)  # the same near-tie rule as greedy/*
            if o.output_ids[:limit] != want[:limit]:
                raise AssertionError(f"prompt {i}: {o.output_ids[:limit]} != sdpa {want[:limit]}")
            compared += limit
        cached = [o.num_cached_tokens for o in outs]
        steps = f"{compared}/{len(prompts) * NEW_TOKENS} steps compared"
        report("PASS", check, f"{len(prompts)} prompts equal sdpa, {steps}; cached {cached}, {len(calls)} cascades")
    except Exception as exc:
        report("FAIL", check, short_error(exc))
        traceback.print_exc(file=sys.stderr)


def check_splitk(backends: dict[str, object]) -> None:
    """Kernel-only TB/s (CUDA graph replay) of the Triton decode by split-K count, ``auto`` being
    ``_choose_num_splits`` (its count in brackets), with the per-call time of ``auto``; the same at
    block_size 16 (the engine's default for Triton: tiles span pages); then, for one 32K-token
    request, by launch knobs (keys per iteration, warps, pipeline stages)."""
    check = "splitk/bf16"
    backend = backends["triton"]
    if isinstance(backend, str):
        report("SKIPPED", check, f"backend unavailable ({backend})")
        return
    h_kv, group, d = 8, 4, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    parts = []
    cases = (
        (256, 1, 32768, (8, 16, 33, 66, 128)),
        (256, 8, 8192, (1, 4, 8, 17, 33)),
        (256, 64, 4096, (1, 2, 4)),
        (16, 1, 32768, (33, 128)),
        (16, 64, 4096, (1,)),
    )
    try:
        for bs, batch, ctx, choices in cases:
            q, k_cache, v_cache, seqlens, table, moved = decode_problem(batch, ctx, bs, h_kv, group, d)
            auto = backend._choose_num_splits(batch, h_kv, table.shape[1] * bs, sms)
            row = []
            for splits in (None, *choices):

                def step(splits=splits, q=q, k_cache=k_cache, v_cache=v_cache, seqlens=seqlens, table=table):
                    return backend.paged_decode_attention(
                        q, k_cache, v_cache, None, None, seqlens, table, softmax_scale=d**-0.5, num_splits=splits
                    )

                seconds, _ = time_kernel(step)
                row.append(f"{f'auto({auto})' if splits is None else splits}:{moved / seconds / 1e12:.2f}")
                if splits is None:
                    per_call = time_cuda(step)
            block = "" if bs == 256 else f"block={bs} "
            parts.append(
                f"{block}B={batch} ctx={ctx} TB/s by splits "
                + " ".join(row)
                + f" (auto per call {per_call * 1e3:.3f} ms)"
            )
            del q, k_cache, v_cache, seqlens, table, step
            torch.cuda.empty_cache()
        parts.append(splitk_knobs(backend, h_kv, group, d))
    except Exception as exc:
        report("FAIL", check, short_error(exc) + (f" (after: {'; '.join(parts)})" if parts else ""))
        traceback.print_exc(file=sys.stderr)
        return
    report("PASS", check, "; ".join(parts))


def splitk_knobs(backend, h_kv: int, group: int, d: int) -> str:
    """One 32K-token request, automatic splits, by (keys per iteration, num_warps, num_stages); the
    backend's module constants are set for the sweep and restored after. None: Triton's default."""
    knobs = ("_DECODE_BLOCK_N", "_DECODE_NUM_WARPS", "_DECODE_NUM_STAGES")
    saved = {k: getattr(backend, k) for k in knobs}
    q, k_cache, v_cache, seqlens, table, moved = decode_problem(1, 32768, 256, h_kv, group, d)

    def step() -> torch.Tensor:
        return backend.paged_decode_attention(q, k_cache, v_cache, None, None, seqlens, table, softmax_scale=d**-0.5)

    row = []
    try:
        for block_n, warps, stages in ((64, None, None), (32, None, None), (128, None, None), (64, 8, None),
                                       (128, 8, None), (64, 4, 2), (64, 4, 4), (128, 4, 2), (32, 4, 4)):  # fmt: skip
            backend._DECODE_BLOCK_N, backend._DECODE_NUM_WARPS, backend._DECODE_NUM_STAGES = block_n, warps, stages
            try:
                seconds, _ = time_kernel(step)
                row.append(f"{block_n}/{warps or '-'}/{stages or '-'}:{moved / seconds / 1e12:.2f}")
            except Exception as exc:  # e.g. out of shared memory: report it and go on
                row.append(f"{block_n}/{warps or '-'}/{stages or '-'}:{type(exc).__name__}")
    finally:
        for k, value in saved.items():
            setattr(backend, k, value)
    return "B=1 ctx=32768 auto TB/s by keys/warps/stages " + " ".join(row)


# ----------------------------------------------------------------------------------------------
# (f) end-to-end throughput on the GPU
# ----------------------------------------------------------------------------------------------


def check_throughput(backends: dict[str, object]) -> None:
    """The ``uniform`` workload in bf16 on the GPU: new tokens/s of each system, and how many requests'
    greedy tokens equal padded ``generate``'s (bf16 near-ties may flip a few; reported, not judged)."""
    check = "throughput/bf16"
    from transformers import AutoModelForCausalLM

    from hf_paged_attn_tools.bench.systems import run_engine, run_hf_cb, run_hf_padded
    from hf_paged_attn_tools.bench.workloads import WORKLOADS

    work = WORKLOADS["uniform"]()
    directory = tempfile.mkdtemp(prefix="gpu_check_bench_")
    work.model.save(directory)

    def load(attn: str) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, dtype=torch.bfloat16)
        return model.to("cuda").eval()

    sdpa, paged, cb = load("sdpa"), load("paged"), load("sdpa")
    runs = [(f"hf_padded@{n}", lambda n=n: run_hf_padded(sdpa, work, n)) for n in (16, 64)]
    kernels = [k for k in ("torch", "triton", "flash") if not isinstance(backends[k], str)]
    sizes = {"flash": 256, "triton": 16, "torch": 16}  # the bench's CPU block size, 8, is below triton's 16
    runs += [
        (f"engine[{k}]@64", lambda k=k: run_engine(paged, work, 64, kernel=k, block_size=sizes[k])) for k in kernels
    ]
    runs.append(("hf_cb@64", lambda: run_hf_cb(cb, work, 64)))
    figures, reference, errors = [], None, []
    for name, fn in runs:
        try:
            torch.cuda.synchronize()
            result = fn()
            torch.cuda.synchronize()
        except Exception as exc:
            errors.append(f"{name}: {short_error(exc)}")
            traceback.print_exc(file=sys.stderr)
            continue
        reference = reference or result.outputs
        same = sum(a == b for a, b in zip(result.outputs, reference, strict=True))
        figures.append(f"{name} {result.tokens_per_second:.0f} tok/s ({same}/{work.num_requests} same)")
        print(f"  {figures[-1]}, {result.wall_seconds:.2f}s", flush=True)
    detail = f"{work.new_tokens} new tokens: " + "; ".join(figures)
    report("FAIL" if errors else "PASS", check, detail + (f"; errors: {'; '.join(errors)}" if errors else ""))


# ----------------------------------------------------------------------------------------------
# graphs/fp32, graphs/bf16: CUDA graphs of decode steps (hf_paged_attn/cuda_graphs.py)
# ----------------------------------------------------------------------------------------------


def check_graphs(dtype_name: str, backends: dict[str, object]) -> None:
    check = f"graphs/{dtype_name}"
    if isinstance(backends["triton"], str):
        report("SKIPPED", check, f"backend unavailable ({backends['triton']})")
        return
    try:
        import hf_paged_attn  # noqa: F401 - registers attn_implementation="paged"

        start = time.perf_counter()
        detail = graphs_parity() if dtype_name == "fp32" else graphs_throughput(backends)
        report("PASS", check, f"{detail}, {time.perf_counter() - start:.1f}s")
    except Exception as exc:
        report("FAIL", check, short_error(exc))
        traceback.print_exc(file=sys.stderr)


def graphs_parity() -> str:
    """Greedy parity with sdpa, Triton backend, ``cuda_graphs=True``: 12 prompts with different
    ``max_new_tokens``, 5 queued first and 7 more after 4 steps, ``max_num_seqs=8``, so decode steps
    run in buckets 8, 4, 2 and 1 while requests finish and start. Fails unless graphs were captured
    and replayed (the runner's counters), every bucket once."""
    from transformers import AutoModelForCausalLM

    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig

    directory = tiny_llama_dir()
    ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").cuda().eval()
    paged = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged").cuda().eval()
    gen = torch.Generator().manual_seed(4)
    lens = [1, 5, 17, 33, 40, 64, 120, 250, 9, 3, 70, 12]
    prompts = [torch.randint(2, ref.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    new = [8 + (7 * i) % 25 for i in range(len(prompts))]
    config = PagedConfig(kernel="triton", cuda_graphs=True, max_num_seqs=8, max_batch_tokens=128, num_blocks=256)
    engine = ContinuousBatchingEngine(paged, config)
    runner = engine.graphs
    if runner is None:
        raise AssertionError("cuda_graphs=True on one CUDA device built no DecodeGraphs runner")
    ids = [engine.add_request(p, n) for p, n in zip(prompts[:5], new[:5], strict=True)]
    finals = {}
    for _ in range(4):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    ids += [engine.add_request(p, n) for p, n in zip(prompts[5:], new[5:], strict=True)]
    finals.update({o.request_id: o for o in engine.stream() if o.finished})
    if runner.failed:
        raise AssertionError(f"a capture failed, the engine ran eagerly: {runner.failed}")
    compared = 0
    for i, (p, n, rid) in enumerate(zip(prompts, new, ids, strict=True)):
        res = ref.generate(torch.tensor([p]).cuda(), max_new_tokens=n, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)  # fmt: skip
        want = res.sequences[0, len(p) :].tolist()
        top2 = torch.stack(res.logits)[:, 0].float().topk(2, dim=-1).values  # [steps, 2]
        ties = ((top2[:, 0] - top2[:, 1]) < TIE_TOLERANCE[torch.float32]).nonzero()
        limit = int(ties[0]) if len(ties) else len(want)  # the same near-tie rule as greedy/*
        got = finals[rid].output_ids
        if finals[rid].finish_reason != "length" or got[:limit] != want[:limit]:
            raise AssertionError(f"prompt {i} ({finals[rid].finish_reason}): {got[:limit]} != sdpa {want[:limit]}")
        compared += limit
    replays = {bucket: c.graph for bucket, c in sorted(runner.captured.items())}
    if runner.num_captures != len(runner.captured) or runner.num_replays <= runner.num_captures:
        raise AssertionError(f"{runner.num_captures} captures of buckets {list(replays)}, {runner.num_replays} replays")
    if not {1, 2, 4, 8} <= set(replays):
        raise AssertionError(f"decode steps replayed only buckets {list(replays)}, expected 1, 2, 4 and 8")
    return (
        f"{len(prompts)} prompts equal sdpa, {compared}/{sum(new)} steps compared (tie tol "
        f"{TIE_TOLERANCE[torch.float32]}); buckets {list(replays)} captured once, {runner.num_replays} replays "
        f"of {engine.stats.num_steps} steps; table width {runner.width} blocks"
    )


def graphs_throughput(backends: dict[str, object]) -> str:
    """The ``uniform`` workload (64 requests, 30M-parameter Llama, bf16) with graphs off and on, per
    graph-safe kernel: new tokens/s of a second run (the first captures the graphs and compiles), the
    first run's time, ms per step, and how many requests' tokens equal the eager run's (figures only)."""
    from transformers import AutoModelForCausalLM

    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn_tools.bench.systems import MAX_BATCH_TOKENS, greedy_config
    from hf_paged_attn_tools.bench.workloads import WORKLOADS

    work = WORKLOADS["uniform"]()
    directory = tempfile.mkdtemp(prefix="gpu_check_graphs_")
    work.model.save(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged", dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    gen_config = greedy_config()
    parts = []
    for kernel, block_size in (("triton", 16), ("flash", 256)):
        if isinstance(backends[kernel], str):
            continue
        results = {}
        for graphs in (False, True):
            config = PagedConfig(
                kernel=kernel, block_size=block_size, num_blocks=work.num_blocks, max_num_seqs=64,
                max_batch_tokens=MAX_BATCH_TOKENS, progress_bar=False, seed=0, cuda_graphs=graphs,
            )  # fmt: skip
            engine = ContinuousBatchingEngine(model, config, gen_config)
            seconds = []
            for _ in range(2):  # the first run compiles kernels and captures the buckets
                before = engine.stats
                torch.cuda.synchronize()
                start = time.perf_counter()
                outs = engine.generate(work.prompts, max_new_tokens=work.max_new_tokens)
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - start)
            after = engine.stats
            steps = after.num_steps - before.num_steps
            step_ms = (after.busy_seconds - before.busy_seconds) / steps * 1e3
            runner = engine.graphs
            results[graphs] = ([o.output_ids for o in outs], seconds, steps, step_ms)
            tag = "on" if graphs else "off"
            extra = f", {runner.num_captures} graphs, {runner.num_replays} replays" if runner else ""
            print(f"  {kernel} graphs {tag}: runs {seconds[0]:.2f}s / {seconds[1]:.2f}s, {steps} steps, "
                  f"{step_ms:.2f} ms/step{extra}", flush=True)  # fmt: skip
            if graphs and (runner is None or runner.num_replays == 0 or runner.failed):
                raise AssertionError(f"{kernel}: graphs on but none replayed ({runner and runner.failed})")
        (eager, (t_off, s_off), *_), (graphed, (t_on, s_on), *_) = results[False], results[True]
        same = sum(a == b for a, b in zip(eager, graphed, strict=True))
        rate_off, rate_on = work.new_tokens / s_off, work.new_tokens / s_on
        parts.append(
            f"{kernel}: off {rate_off:.0f} tok/s ({results[False][3]:.2f} ms/step), on {rate_on:.0f} tok/s "
            f"({results[True][3]:.2f} ms/step) = {rate_on / rate_off:.2f}x; first run with captures {t_on:.2f}s "
            f"vs {t_off:.2f}s; {same}/{work.num_requests} same tokens"
        )
    return "; ".join(parts)


# ----------------------------------------------------------------------------------------------
# (g) layers on two devices (accelerate's device_map)
# ----------------------------------------------------------------------------------------------


def mixed_device_map(num_layers: int, gpu: str) -> dict[str, str]:
    """The first half of the layers (and the embeddings) on ``gpu``, the rest (and the head) on the CPU."""
    half = num_layers // 2
    layers = {f"model.layers.{i}": gpu if i < half else "cpu" for i in range(num_layers)}
    return {"model.embed_tokens": gpu, "model.rotary_emb": gpu, **layers, "model.norm": "cpu", "lm_head": "cpu"}


def load_mixed(directory: str, attn: str, mode: str, gpu: str) -> torch.nn.Module:
    from accelerate import dispatch_model
    from transformers import AutoConfig, AutoModelForCausalLM

    device_map = mixed_device_map(AutoConfig.from_pretrained(directory).num_hidden_layers, gpu)
    if mode == "offload":  # accelerate's meaning of "cpu" next to a GPU: weights there, execution on the GPU
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, device_map=device_map)
    else:  # main_device="cpu": the "cpu" half really executes on the CPU
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn)
        skip = model._skip_keys_device_placement  # as from_pretrained passes it: hooks leave the cache alone
        model = dispatch_model(model, device_map=device_map, main_device="cpu", skip_keys=skip)
    return model.eval()


def mixed_parity(directory: str, mode: str, gpu: str = "cuda:0") -> str:
    """Greedy parity of the paged engine against sdpa under the same half-GPU, half-CPU map, pages
    checked layer by layer; returns the detail line, raises AssertionError on a mismatch."""
    from hf_paged_attn import ContinuousBatchingEngine
    from hf_paged_attn.runtime.placement import input_device, layer_devices
    from hf_paged_attn_tools.testing import compare_greedy

    ref, paged = load_mixed(directory, "sdpa", mode, gpu), load_mixed(directory, "paged", mode, gpu)
    num_layers = paged.config.num_hidden_layers
    expected_devices = [torch.device(gpu)] * num_layers
    if mode == "split":
        expected_devices[num_layers // 2 :] = [torch.device("cpu")] * (num_layers - num_layers // 2)
    if layer_devices(paged) != expected_devices:
        raise AssertionError(f"layer_devices {layer_devices(paged)} != the map's {expected_devices}")

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, paged.config.vocab_size, (n,), generator=gen).tolist() for n in (1, 5, 17, 33, 64, 120)]
    device = input_device(ref)
    expected = []
    for p in prompts:
        out = ref.generate(torch.tensor([p], device=device), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, len(p) :].tolist())

    engine = ContinuousBatchingEngine(paged)  # sized from memory: every device that holds layers is asked
    steps = []  # every step's metadata, as the engine opens it on the cache
    open_step = engine.cache.step
    engine.cache.step = lambda meta: steps.append(meta) or open_step(meta)
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    problems = compare_greedy(ref, prompts, expected, [o.output_ids for o in outputs], TIE_TOLERANCE[torch.float32])
    if problems:
        raise AssertionError("; ".join(problems))
    pages = [layer.keys.device for layer in engine.cache.layers]
    if pages != expected_devices:
        raise AssertionError(f"pages on {pages}, layers execute on {expected_devices}")
    # one copy of the step's tensors per other device per step, shared by that device's layers
    copied = {tuple(sorted(str(d) for d in meta.copies if d != meta.input_ids.device)) for meta in steps}
    want = {("cpu",)} if mode == "split" else {()}
    if copied != want:
        raise AssertionError(f"step metadata copied to {copied}, expected {want}")
    where = ", ".join(f"{n} layers on {d}" for d, n in sorted(Counter(map(str, pages)).items()))
    return (
        f"{len(prompts)} prompts x {NEW_TOKENS} tokens equal sdpa (tie tol {TIE_TOLERANCE[torch.float32]}); "
        f"pages: {where}; {engine.allocator.num_blocks} blocks, kernel {engine.config.kernel}, {len(steps)} steps"
    )


def check_mixed(mode: str, directory: str | None) -> None:
    check = f"mixed/{mode}"
    try:
        import hf_paged_attn  # noqa: F401 - registers attn_implementation="paged"

        if directory is None:
            raise RuntimeError("the tiny model could not be built (see above)")
        start = time.perf_counter()
        detail = mixed_parity(directory, mode)
        report("PASS", check, f"{detail}, {time.perf_counter() - start:.1f}s")
    except Exception as exc:
        report("FAIL", check, short_error(exc))
        traceback.print_exc(file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# (h) end to end: a ~0.5B-parameter Qwen2-shaped model
# ----------------------------------------------------------------------------------------------

# Qwen2.5-0.5B's shape (494M parameters). Random weights: initializer_range 0.05 (default 0.02) makes
# greedy tokens vary (16 distinct of 16 over two prompts, measured on CPU in fp32, 2 and 24 layers;
# at 0.02 a 2-layer model repeats 4 tokens).
QWEN2_SIZES = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936)  # fmt: skip
TINY_QWEN2_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=512)  # fmt: skip
# The workload: 64 prompts of 64-512 tokens, 128 new tokens each, greedy, no EOS; the --tiny dry run
# keeps the shape of it at a size the CPU runs in seconds.
E2E_WORK = dict(num_prompts=64, min_len=64, max_len=512, new_tokens=128, max_batch_tokens=4096, step_tokens=24)
TINY_E2E_WORK = dict(num_prompts=8, min_len=8, max_len=40, new_tokens=8, max_batch_tokens=128, step_tokens=16)


def qwen2_config(tiny: bool, num_layers: int | None = None):
    from transformers import Qwen2Config

    sizes = dict(TINY_QWEN2_SIZES if tiny else QWEN2_SIZES)
    if num_layers is not None:
        sizes["num_hidden_layers"] = num_layers
    return Qwen2Config(
        **sizes, tie_word_embeddings=True, initializer_range=0.05, max_position_embeddings=4096,
        rope_theta=1e6, use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


def save_qwen2(config, device: str, dtype: torch.dtype) -> str:
    """Random weights made on ``device`` (fast on a GPU), saved with save_pretrained in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    directory = tempfile.mkdtemp(prefix="gpu_check_qwen2_")
    model.save_pretrained(directory)
    del model
    return directory


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def e2e_prompts(work: dict, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(work["min_len"], work["max_len"] + 1, (work["num_prompts"],), generator=gen).tolist()
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lens]


def engine_config(model, prompts: list[list[int]], work: dict):
    """The engine's config: the best kernel for the model (``kernel="auto"``), a cache sized to the
    workload (so both systems leave the rest of the memory alone), the shared token budget."""
    import dataclasses

    from hf_paged_attn import PagedConfig
    from hf_paged_attn.core.blocks import blocks_for

    config = PagedConfig(
        max_num_seqs=len(prompts), max_batch_tokens=work["max_batch_tokens"], progress_bar=False, seed=0
    ).for_model(model)
    need = sum(blocks_for(len(p) + work["new_tokens"], config.block_size) for p in prompts)
    return dataclasses.replace(config, num_blocks=need + len(prompts))


def time_engine(model, prompts: list[list[int]], work: dict, device: str) -> tuple[float, list[list[int]], str]:
    """New tokens/s of the engine on the whole workload (after a warm-up on its first 8 prompts)."""
    from hf_paged_attn import ContinuousBatchingEngine
    from hf_paged_attn_tools.bench.systems import greedy_config

    config = engine_config(model, prompts, work)
    engine = ContinuousBatchingEngine(model, config, greedy_config())
    engine.generate(prompts[:8], max_new_tokens=4)  # kernels compiled, pages allocated
    sync(device)
    start = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=work["new_tokens"])
    sync(device)
    wall = time.perf_counter() - start
    if any(o.finish_reason == "error" for o in outs):
        raise RuntimeError(f"engine request failed: {next(o.error for o in outs if o.finish_reason == 'error')}")
    return len(prompts) * work["new_tokens"] / wall, [o.output_ids for o in outs], config.kernel


def engine_decode_step(model, prompts: list[list[int]], work: dict, device: str) -> float:
    """Median seconds of one whole engine step (schedule, build, forward, sample, bookkeeping) while
    every request decodes, each step framed by torch.cuda.synchronize."""
    from hf_paged_attn import ContinuousBatchingEngine
    from hf_paged_attn_tools.bench.systems import greedy_config

    engine = ContinuousBatchingEngine(model, engine_config(model, prompts, work), greedy_config())
    ids = {engine.add_request(p, max_new_tokens=work["step_tokens"]) for p in prompts}
    decoding: set[str] = set()  # requests past their prefill: a step with all of them is a decode step
    times = []
    while engine.has_unfinished():
        all_decode = decoding == ids
        sync(device)
        start = time.perf_counter()
        outs = engine.step()
        sync(device)
        if all_decode and not any(o.finished for o in outs):
            times.append(time.perf_counter() - start)
        decoding |= {o.request_id for o in outs if o.output_ids}
    if not times:
        raise RuntimeError("no step ran with every request decoding")
    return sorted(times)[len(times) // 2]


def forward_only_decode(model, prompts: list[list[int]], device: str, iters: int = 10) -> float:
    """Median seconds of transformers' own forward (sdpa, DynamicCache) for one new token of every
    request, the prompts left-padded into one batch: the model's cost without any engine."""
    from hf_paged_attn_tools.testing import left_padded

    ids, mask = (t.to(device) for t in left_padded(prompts))
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)  # [B, 1]
        for _ in range(iters + 2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [B, K + 1]
            positions = mask.sum(-1, keepdim=True) - 1  # [B, 1]
            sync(device)
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True, logits_to_keep=1)  # fmt: skip
            token = out.logits[:, -1:].argmax(-1)
            sync(device)
            times.append(time.perf_counter() - start)
    times = times[2:]  # warm-up
    return sorted(times)[len(times) // 2]


def time_hf_cb(model, prompts: list[list[int]], work: dict) -> tuple[float, list[list[int]], str]:
    """New tokens/s of transformers' continuous batching with CUDA graphs on (its own attention choice:
    flash-attn when installed, else sdpa), after its graph warm-up and a warm-up batch."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from hf_paged_attn_tools.bench.systems import _collect, greedy_config

    cb_config = ContinuousBatchingConfig(
        use_cuda_graph=True, max_batch_tokens=work["max_batch_tokens"], max_requests_per_batch=len(prompts), seed=0
    )
    gen_config = greedy_config()
    gen_config.eos_token_id = -1  # what init_continuous_batching sets for "no EOS"
    # The hints generate_batch gives it (they size its flash-attn decode fast path's block table)
    hints = WorkloadHints(max(map(len, prompts)), work["new_tokens"], len(prompts))
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    attn = model.config._attn_implementation
    resolved = manager.continuous_batching_config
    how = f"{attn}, cuda graphs (varlen, decode)={resolved.use_cuda_graph}, async={resolved.use_async_batching}"
    try:
        manager.warmup()  # captures its CUDA graphs
        manager.start()
        _collect(manager, [manager.add_request(p, max_new_tokens=4) for p in prompts[:8]], timeout=120)
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=work["new_tokens"]) for p in prompts]
        results = _collect(manager, ids, timeout=120)
        wall = time.perf_counter() - start  # results come back on the host: nothing left to sync
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    outputs = [list(results[r].generated_tokens) for r in ids]
    return len(prompts) * work["new_tokens"] / wall, outputs, how


def e2e_throughput(device: str, tiny: bool) -> str:
    """The engine against transformers' continuous batching on the ~0.5B model in bf16; returns the
    detail line."""
    from transformers import AutoModelForCausalLM

    import hf_paged_attn  # noqa: F401 - registers attn_implementation="paged"

    work = TINY_E2E_WORK if tiny else E2E_WORK
    config = qwen2_config(tiny)
    start = time.perf_counter()
    directory = save_qwen2(config, device, torch.bfloat16)

    def load(attn: str):
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, dtype=torch.bfloat16)
        return model.to(device).eval()

    paged, ref = load("paged"), load("sdpa")
    params = sum(p.numel() for p in paged.parameters()) / 1e6
    prompts = e2e_prompts(work, config.vocab_size)
    parts = [
        f"{params:.1f}M params built in {time.perf_counter() - start:.0f}s, {len(prompts)} prompts of "
        f"{work['min_len']}-{work['max_len']} tokens x {work['new_tokens']} new, "
        f"max_batch_tokens {work['max_batch_tokens']}"
    ]

    def phase(name: str, fn: Callable[[], object]):
        try:
            return fn()
        except Exception as exc:  # keep the figures measured so far
            raise RuntimeError(f"{name}: {short_error(exc)} (after: {'; '.join(parts)})") from exc

    engine_tps, engine_out, kernel = phase("engine", lambda: time_engine(paged, prompts, work, device))
    parts.append(f"engine[{kernel}] {engine_tps:.0f} tok/s")
    step = phase("engine decode step", lambda: engine_decode_step(paged, prompts, work, device))
    forward = phase("forward-only", lambda: forward_only_decode(ref, prompts, device))  # before hf_cb switches it
    step_ratio = step / forward
    parts.append(
        f"decode step of {len(prompts)}: engine {step * 1e3:.2f} ms vs sdpa forward-only {forward * 1e3:.2f} ms = "
        f"{step_ratio:.2f}x (goal <= 1.3x: {'met' if step_ratio <= 1.3 else 'NOT met'})"
    )
    cb_tps, cb_out, cb_how = phase("hf_cb", lambda: time_hf_cb(ref, prompts, work))
    ratio = engine_tps / cb_tps
    same = sum(a == b for a, b in zip(engine_out, cb_out, strict=True))
    parts.append(
        f"hf_cb[{cb_how}] {cb_tps:.0f} tok/s: engine = {ratio:.2f}x "
        f"(goal >= 2x: {'met' if ratio >= 2 else 'NOT met'}); "
        f"{same}/{len(prompts)} requests' tokens equal hf_cb's (bf16: not judged)"
    )
    return "; ".join(parts)


def e2e_parity(device: str, tiny: bool, kernels: list[str]) -> str:
    """The model's architecture with 2 layers: paged (each of ``kernels``) against sdpa, greedy,
    through prefix hits, chunked prefill and mixed steps, with every varlen step prefilling straight
    from the pages (no gather); fp32, or bf16 for flash-attn (no fp32). Returns the detail line."""
    config = qwen2_config(tiny, num_layers=2)
    gen = torch.Generator().manual_seed(4)
    head = torch.randint(2, config.vocab_size, (40,), generator=gen).tolist()  # shared: prefix hits
    tails = (5, 30, 80) if tiny else (5, 30, 80, 150, 300)
    prompts = [head + torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in tails]
    new = 8 if tiny else NEW_TOKENS
    parts = [parity_of_kernel(config, prompts, new, kernel, device) for kernel in kernels]
    lens = f"{len(head) + min(tails)}-{len(head) + max(tails)}"
    return f"{len(prompts)} prompts of {lens} tokens (shared first 40) x {new}: " + "; ".join(parts)


def parity_of_kernel(config, prompts: list[list[int]], new: int, kernel: str, device: str) -> str:
    from transformers import AutoModelForCausalLM

    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn.attention.cache import PagedLayer
    from hf_paged_attn.kernels import BACKENDS
    from hf_paged_attn_tools.testing import compare_greedy

    dtype = torch.bfloat16 if kernel == "flash" else torch.float32
    directory = save_qwen2(config, device, dtype)
    ref, paged = (
        AutoModelForCausalLM.from_pretrained(directory, attn_implementation=a, dtype=dtype).to(device).eval()
        for a in ("sdpa", "paged")
    )
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        expected.append(out[0, len(p) :].tolist())
    backend = BACKENDS[kernel].load(torch.device(device))
    counts = Counter()
    gather, prefill = PagedLayer.gather, backend.paged_prefill_attention
    PagedLayer.gather = lambda self, slots: counts.update(["gather"]) or gather(self, slots)
    backend.paged_prefill_attention = lambda *a, **k: counts.update(["prefill"]) or prefill(*a, **k)
    block = 256 if kernel == "flash" else 16
    try:
        # 64 tokens a step: prompts of 45-340 tokens prefill in chunks beside other requests' decodes
        engine = ContinuousBatchingEngine(
            paged, PagedConfig(kernel=kernel, block_size=block, max_batch_tokens=64, num_blocks=256)
        )
        first = engine.generate(prompts[:1], max_new_tokens=new)  # its full blocks are cached now
        outs = first + engine.generate(prompts[1:], max_new_tokens=new)
    finally:
        PagedLayer.gather, backend.paged_prefill_attention = gather, prefill
    got = [o.output_ids for o in outs]
    problems = compare_greedy(ref, prompts, expected, got, TIE_TOLERANCE[dtype])
    if problems:
        raise AssertionError(f"{kernel}: " + "; ".join(problems))
    cached = sum(o.num_cached_tokens for o in outs)
    if counts["gather"] or not counts["prefill"] or not (cached or block > 40):
        raise AssertionError(f"{kernel}: {dict(counts)} gathers/prefill calls, {cached} cached tokens")
    exact = sum(a == b for a, b in zip(expected, got, strict=True))
    return (
        f"{kernel} ({str(dtype)[6:]}): {exact}/{len(prompts)} equal (rest up to a near-tie), "
        f"{counts['prefill']} paged prefill calls, 0 gathers, {cached} cached tokens"
    )


def check_e2e(kind: str, backends: dict[str, object], device: str = "cuda", tiny: bool = False) -> None:
    check = f"e2e/{kind}"
    try:
        start = time.perf_counter()
        if kind == "bf16":
            detail = e2e_throughput(device, tiny)
        else:
            kernels = [k for k in ("triton", "flash") if not isinstance(backends.get(k, "absent"), str)]
            if not kernels:
                report("SKIPPED", check, f"no kernel that prefills from the pages: {backends}")
                return
            detail = e2e_parity(device, tiny, kernels)
        report("PASS", check, f"{detail}, {time.perf_counter() - start:.1f}s")
    except Exception as exc:  # report, never crash the script
        report("FAIL", check, short_error(exc))
        traceback.print_exc(file=sys.stderr)
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def tiny_e2e_dry_run(wanted: list[str]) -> int:
    """``--tiny``: the e2e checks on a tiny model on this machine's CPU, Triton through its
    interpreter: their code path runs before a GPU ever sees it (figures meaningless)."""

    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton
    from hf_paged_attn.kernels import BACKENDS

    BACKENDS["triton"].is_available = lambda device: True
    backends = load_backends()
    for check in wanted:
        if check.startswith("e2e/"):
            check_e2e(check.split("/")[1], {"triton": backends["triton"]}, device="cpu", tiny=True)
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated check prefixes (e.g. kernels/triton,greedy)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tiny_e2e_dry_run
    args = parser.parse_args()
    wanted = [c for c in CHECKS if not args.only or any(c.startswith(p) for p in args.only.split(","))]
    if args.tiny:
        return tiny_e2e_dry_run(wanted)

    if not torch.cuda.is_available():
        for check in wanted:
            report("SKIPPED", check, "no CUDA device")
        return 0

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references and backends stay IEEE fp32
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    backends = load_backends()
    directory = None
    if any(c.startswith(("greedy", "cascade", "mixed")) for c in wanted):  # one model for every greedy check
        try:
            directory = tiny_llama_dir()
        except Exception as exc:
            print(f"could not build the tiny Llama: {short_error(exc)}", flush=True)
    run_start = time.perf_counter()
    pending = list(wanted)
    signal.signal(signal.SIGTERM, lambda signum, frame: out_of_time(pending, run_start))
    for check in wanted:
        kind, *rest = check.split("/")
        check_start = time.perf_counter()
        try:
            if kind == "kernels":
                check_kernels(backends, rest[0], rest[1])
            elif kind == "greedy":
                check_greedy(rest[0], rest[1], directory, backends)
            elif kind == "cascade":
                check_cascade(directory)
            elif kind == "splitk":
                check_splitk(backends)
            elif kind == "throughput":
                check_throughput(backends)
            elif kind == "mixed":
                check_mixed(rest[0], directory)
            elif kind == "graphs":
                check_graphs(rest[0], backends)
            elif kind == "e2e":
                check_e2e(rest[0], backends)
            else:
                check_bandwidth(backends, rest[0])
        except Exception as exc:  # one broken check must not hide the others
            report("FAIL", check, short_error(exc))
        pending.remove(check)
        now = time.perf_counter()
        print(f"  ({check}: {now - check_start:.0f}s, {now - run_start:.0f}s so far)", flush=True)
    print(f"{len(wanted) - len(failures)} passed or skipped, {len(failures)} failed", flush=True)
    return 1 if failures else 0


def out_of_time(pending: list[str], run_start: float) -> None:
    """SIGTERM from ``timeout`` in gpu_check.sh: a line for the check that was running and for each
    one that never started, then exit at once (unwinding through CUDA work could take longer)."""
    elapsed = time.perf_counter() - run_start
    for i, check in enumerate(pending):
        if i == 0:
            report("FAIL", check, f"still running when the time limit came, {elapsed:.0f}s into the run")
        else:
            report("SKIPPED", check, "not started: the time limit (GPU_CHECK_TIMEOUT) came first")
    print(f"stopped at the time limit: {len(failures)} failed, {len(pending) - 1} not started", flush=True)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
