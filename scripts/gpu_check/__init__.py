"""The GPU acceptance checks, run when a GPU machine is lent to us (no network; about 5 minutes on
one H100/H200 before graphs/* and e2e/*, whose time is not yet measured):

    bash scripts/gpu_check.sh [--only PREFIXES] [--json PATH] [--budget-scale X]

prints one line per check, ``[PASS|FAIL|SKIPPED] <check>: <details>``, and its seconds. In run order
(``registry.ORDER``: parity first, figures after, throughput last), one module of ``checks/`` each:

- ``lora/kernels`` (lora.py): the Triton LoRA kernels (shrink, expand) against their float64 reference, each
  element within the rounding bound of their arithmetic, fp32 / bf16 / fp16 and fp32 adapters on a bf16 base.
- ``lora/engine-fp32`` (lora.py): the engine's LoRA router on those kernels, requests under two adapters and the
  base against PEFT on sdpa, greedy.
- ``kernels/<backend>/<dtype>`` (kernels.py): triton, flash (when importable) and torch against the
  float64 reference: paged decode (Triton split-K forced and automatic), paged prefill, write_kv then
  paged prefill, with GQA, windows, softcap and sinks.
- ``greedy/<dtype>/<kernel>`` (greedy.py): a tiny random Llama, ``attn_implementation="paged"`` with
  ``PagedConfig(kernel=...)`` against ``"sdpa"``, 32 greedy tokens per prompt through the public API.
- ``graphs/fp32`` (graphs_parity.py): greedy parity while decode steps replay CUDA graphs
  (``CudaGraphExecutor``), every bucket captured once and replayed.
- ``e2e/fp32-parity`` (e2e_parity.py): Qwen2.5-0.5B's architecture with 2 layers, paged against sdpa
  through prefix hits, chunked prefill and mixed steps, every prefill read from the pages.
- ``cascade/fp32`` (cascade.py): a shared 96-token prefix takes the torch backend's cascade decode.
- ``mixed/offload``, ``mixed/split`` (mixed.py): half the layers on ``cuda:0``, half on the CPU.
- ``window/bf16/flash`` (windows.py): a Gemma-2-shaped random model (sliding and full layers) on
  flash-attn against ``"eager"``, prompts past window + one page of 256, prefilled in chunks.
- ``bandwidth/<backend>`` (bandwidth.py): paged decode, K/V bytes per second against the peak,
  kernel-only (CUDA-graph replays) and per call. Figures only.
- ``splitk/bf16`` (splitk.py): the Triton decode by split-K count and launch knobs. Figures only.
- ``graphs/bf16`` (graphs_throughput.py): the ``uniform`` workload with CUDA graphs off and on.
- ``e2e/bf16`` (e2e_throughput.py): a 0.5B random Qwen2 against transformers' continuous batching
  (goal >= 2x) and a decode step against the forward-only time (goal <= 1.3x).
- ``throughput/bf16`` (throughput.py): the ``uniform`` workload, every kernel against transformers'
  padded ``generate`` and continuous batching.

The harness (``harness.py``) gives each check a time budget (stopped there, FAIL, the run goes on)
and, at the run's limit (SIGTERM from ``timeout``), reports the running check FAIL and the rest
SKIPPED. Without CUDA every check prints SKIPPED and it exits 0; otherwise 1 if a check failed.

Without a GPU: ``--list`` prints the checks; ``--dry-run`` imports every check and resolves every API
it uses (``apis.py``); ``--device cpu`` runs every check's CPU variant: tiny shapes, Triton through
its interpreter, parity judged as on the GPU, figures meaningless, ``mixed/*`` with both halves on
the CPU. ``tests/tools/test_gpu_check.py`` runs all three (the figure checks under ``-m slow``).
"""
