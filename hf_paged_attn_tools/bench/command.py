"""Benchmark the paged engine against transformers on one model, one set of requests, one process.

    python -m hf_paged_attn_tools.bench --smoke                  # tiny model, seconds
    python -m hf_paged_attn_tools.bench --workload uniform       # 64 requests (several minutes on 2 cores)
    python -m hf_paged_attn_tools.bench --workload shared-prefix
    python -m hf_paged_attn_tools.bench --workload scale [--with-baselines]
    python -m hf_paged_attn_tools.bench --profile                # engine only: ms per step by part
    python -m hf_paged_attn_tools.bench --serve [--model random]  # HTTP: our server vs transformers serve
    python -m hf_paged_attn_tools.bench --ab '{"compile": false}' '{}' [--rounds 3]  # two PagedConfigs, A/B
    python -m hf_paged_attn_tools.bench kernels                 # the attention kernels alone (kernels.py)
    python -m hf_paged_attn_tools.bench vllm --vllm-python PATH  # against vLLM's CPU build (vs_vllm.py)
    python -m hf_paged_attn_tools.bench guidellm [--smoke]       # guidellm against both servers (guidellm.py)

Writes OUT/<workload>.json and OUT/<workload>_throughput.png. OUT is --out, by default a folder in the
user's cache ($XDG_CACHE_HOME/hf_paged_attn/bench, else ~/.cache/hf_paged_attn/bench), never the
current directory; make bench passes --out benchmarks/results. Figures and what they mean: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from hf_paged_attn._env import OPENMP_WAITING
from hf_paged_attn_tools.bench.report import build_report, default_out_dir, format_table, plot
from hf_paged_attn_tools.bench.runner import DTYPE as LOAD_DTYPE
from hf_paged_attn_tools.bench.runner import run_workload
from hf_paged_attn_tools.bench.systems import COMPILE as SYSTEMS_COMPILE
from hf_paged_attn_tools.bench.systems import SYSTEMS
from hf_paged_attn_tools.bench.workloads import WORKLOADS, Workload

PROG = "python -m hf_paged_attn_tools.bench"  # the usage line's command; hf-paged-attn bench passes its own
SUBCOMMANDS = {  # name -> (module, function(argv, prog))
    "kernels": ("kernels", "main"),
    "vllm": ("vs_vllm", "main"),
    "guidellm": ("guidellm", "run"),
}
DEFAULT_SYSTEMS = {
    "uniform": ["engine", "generate", "hf_cb", "hf_padded"],
    "shared-prefix": ["engine", "engine+prefix", "generate", "hf_cb", "hf_padded"],
    "scale": ["engine"],
    "smoke": ["engine", "generate", "hf_cb", "hf_padded"],
}


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=[w for w in WORKLOADS if w != "smoke"], default="uniform")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 6 requests, 8 new tokens (seconds)")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"directory for the JSON and PNG (default: {default_out_dir()})"
    )
    parser.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--with-baselines", action="store_true", help="scale: also run hf_cb and hf_padded")
    parser.add_argument("--concurrency", help="comma-separated sweep levels (default: the workload's)")
    parser.add_argument("--requests", type=int, help="override the number of requests (quick runs)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--profile", action="store_true",
        help="profile the engine alone at the first --concurrency level (default the headline): per-step "
        "host, attention, linear and other milliseconds (hf_paged_attn_tools/bench/profile.py); writes nothing",
    )
    parser.add_argument("--profile-ops", type=int, default=0, metavar="N",
                        help="with --profile: also torch.profiler's N most expensive ops (a second run)")
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                        help="PagedConfig.compile of the paged systems (auto: its default, on for the CPU); "
                        "--profile always runs eagerly (its hooks would split the compiled graph)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the dtype every system loads the model in")
    parser.add_argument("--serve", action="store_true", help="benchmark the HTTP servers instead (--serve --help)")
    parser.add_argument("--ab", nargs=2, metavar=("A", "B"), help="run the engine with two PagedConfig overrides "
                        "(JSON objects), alternating in one process, and compare them (--rounds)")
    parser.add_argument("--rounds", type=int, default=3, help="with --ab: runs of each variant")
    return parser.parse_args(argv)


def build_workload(args: argparse.Namespace) -> Workload:
    name = "smoke" if args.smoke else args.workload
    if args.requests and name != "smoke":
        return WORKLOADS[name](num_requests=args.requests)
    return WORKLOADS[name]()


def run(argv: list[str] | None = None, prog: str = PROG) -> dict[str, Any]:
    """Run the benchmark described by ``argv``; write and return the report."""
    args = parse_args(argv, prog)
    if args.threads > 1 and not any(os.environ.get(k) for k in OPENMP_WAITING):
        print(
            "note: OMP_WAIT_POLICY and GOMP_SPINCOUNT are unset; on a shared or oversubscribed CPU, OpenMP's "
            "spinning threads can make every forward 10x slower. Set OMP_WAIT_POLICY=PASSIVE or GOMP_SPINCOUNT=3000 "
            "in the environment (before Python starts).",
            file=sys.stderr,
        )
    work = build_workload(args)
    SYSTEMS_COMPILE["compile"] = {"auto": None, "on": True, "off": False}[args.compile]
    LOAD_DTYPE["dtype"] = getattr(__import__("torch"), args.dtype)
    if args.ab:
        from hf_paged_attn_tools.bench.ab import run_ab

        return run_ab(work, {"A": json.loads(args.ab[0]), "B": json.loads(args.ab[1])}, args.rounds, args.threads)
    if args.profile:
        from hf_paged_attn_tools.bench.profile import print_profile, profile_workload

        level = int(args.concurrency.split(",")[0]) if args.concurrency else work.headline["continuous"]
        result = profile_workload(work, level, threads=args.threads, ops=args.profile_ops)
        print_profile(result)
        return result
    if args.systems:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    else:
        systems = list(DEFAULT_SYSTEMS[work.name])
        if args.with_baselines:
            systems += [s for s in ("hf_cb", "hf_padded") if s not in systems]
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else None
    runs, bound, env = run_workload(work, systems, threads=args.threads, concurrency=levels)
    report = build_report(work, runs, bound, env)
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_plot:
        report["plot"] = str(plot(report, out / f"{work.name}_throughput.png"))
    (out / f"{work.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {out / f'{work.name}.json'}" + (f" and {report['plot']}" if "plot" in report else ""))
    return report


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:  # experiments with options of their own: COMMAND --help
        module, function = SUBCOMMANDS[argv[0]]
        entry = getattr(__import__(f"hf_paged_attn_tools.bench.{module}", fromlist=[function]), function)
        entry(argv[1:], prog=f"{prog} {argv[0]}")
        return None
    if "--serve" in argv:  # its own options: see hf_paged_attn_tools.bench.serve
        from hf_paged_attn_tools.bench.serve import main as serve_main

        argv.remove("--serve")
        return serve_main(argv, prog=f"{prog} --serve")
    run(argv, prog)
