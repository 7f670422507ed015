"""guidellm (vLLM's load generator) against ``hf-paged-attn serve`` and ``transformers serve --continuous-batching``.

    GUIDELLM=/path/to/venv/bin/guidellm hf-paged-attn bench guidellm            # demo model, 8 and 32 clients
    hf-paged-attn bench guidellm --model random --guidellm /path/to/guidellm   # 28M random Llama
    hf-paged-attn bench guidellm --smoke                                       # 2 clients, 4 requests (~30 s)

guidellm is not a dependency of this project: install it in a virtual environment of its own
(``python3 -m venv /work/guidellm-venv && /work/guidellm-venv/bin/pip install guidellm==0.8.1 torch==2.13.0``;
it needs torch, and without the pin pip pulls CUDA's) and name its executable with ``--guidellm``
or ``$GUIDELLM`` (default: ``guidellm`` on ``PATH``).

One server at a time (the machine's cores are shared: never both at once), each on 127.0.0.1 and a
free port, on the same local model directory and dtype, ``OMP_NUM_THREADS=--threads``. After one
warm-up request (and, for ours, once the background ``torch.compile`` of the forward is done, so
the run measures the server as it runs from then on), one ``guidellm run`` per server: the
``concurrent`` profile at each ``--concurrency`` level, synthetic prompts of ``--prompt-tokens``
tokens (guidellm's generator, its default seed: the same prompts for both servers) asking for
``--output-tokens`` tokens each, ``--requests-per-client`` x level requests per level (and at most
``--max-seconds``), streamed ``/v1/completions``, with one guidellm worker process
(``--guidellm-workers``; with its default, up to 10 spawned processes, our server gave 42% fewer
tokens per second in one comparison on this project's 2-core machine). guidellm is run unchanged;
what it sends:

    {"model", "prompt", "max_tokens": N, "ignore_eos": true, "stream": true,
     "stream_options": {"include_usage": true, "continuous_usage_stats": true}}

``transformers serve`` answers 422 to a field it does not know (``ignore_eos``), so its backend gets
guidellm's own ``extras`` option: ``{"body": {"ignore_eos": null, "generation_config": "..."}}``
(guidellm drops null fields from the body; ``generation_config`` is transformers serve's field, a
JSON generation config, here ``{"eos_token_id": -1}``, which keeps EOS from ending a request early,
as ``ignore_eos`` does for ours). The table gives guidellm's figures per system and level: requests
ok / failed (errored + incomplete), output tokens per second (guidellm's ``output_tokens_per_second``
mean over the level's run), TTFT and ITL medians, output tokens per request, and ours / theirs.
With ``--repeat`` > 1 the systems alternate and the table shows medians. Writes
``OUT/guidellm_<model>.json`` (``--out``, default the bench's folder in the user's cache) and keeps
guidellm's own reports beside it (``guidellm_<model>_<system>_<run>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from hf_paged_attn.runtime.cpu.compiled import COMPILE_AFTER_STEPS
from hf_paged_attn_tools.bench.report import default_out_dir
from hf_paged_attn_tools.bench.serve import free_port, model_dir
from hf_paged_attn_tools.launch import ServerProcess

SYSTEMS = ("paged", "transformers")
COMPILED = ("compiled the model's forward", "compiling the model's forward failed")
# transformers serve: no ignore_eos (a 422), and EOS must not end a request early (ours ignores it).
TRANSFORMERS_EXTRAS = {"body": {"ignore_eos": None, "generation_config": json.dumps({"eos_token_id": -1})}}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="'demo' (bundled), 'random' (28M random Llama) or a local path")
    p.add_argument("--guidellm", default=os.environ.get("GUIDELLM") or shutil.which("guidellm"),
                   help="the guidellm executable (default: $GUIDELLM, else guidellm on PATH)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--concurrency", default="8,32", help="guidellm's concurrent streams, one level each")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=16, help="requests per level: this x the level")
    p.add_argument("--max-seconds", type=float, default=180.0, help="cap on each level's run")
    p.add_argument("--repeat", type=int, default=1, help="runs per system, alternating systems; medians reported")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each server")
    p.add_argument("--dtype", default="float32", help="both servers load the model in it")
    p.add_argument("--guidellm-workers", type=int, default=1,
                   help="guidellm's worker processes (GUIDELLM__MAX_WORKER_PROCESSES); 0: its own default, "
                        "min(streams, 10), which on 2 shared cores takes CPU from the server")
    p.add_argument("--no-compile", action="store_true", help="our server without its background torch.compile")
    p.add_argument("--out", type=Path, default=None, help=f"directory for the JSON (default: {default_out_dir()})")
    p.add_argument("--smoke", action="store_true", help="2 clients x 2 requests, 16 + 16 tokens, no compile")
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests_per_client, args.prompt_tokens, args.output_tokens = "2", 2, 16, 16
        args.repeat, args.no_compile, args.max_seconds = 1, True, 120.0
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.system_list) - set(SYSTEMS)
    if unknown or not args.levels or min(args.levels) < 1:
        p.error(f"bad --systems {sorted(unknown)} or --concurrency {args.concurrency!r}")
    if not args.guidellm or not Path(args.guidellm).exists():
        p.error("guidellm not found: pass --guidellm PATH or set $GUIDELLM (install: see this script's docstring)")
    return args


def start_server(system: str, model: Path, args: argparse.Namespace) -> ServerProcess:
    """Our server or transformers', ready on 127.0.0.1; both sized for the largest level."""
    env = {"OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE", **OFFLINE}
    clients = max(args.levels)
    if system == "paged":
        max_len = args.prompt_tokens + args.output_tokens + 16  # guidellm's prompts come within a few tokens
        flags = ["--served-model-name", str(model), "--dtype", args.dtype, "--max-num-seqs", str(clients),
                 "--num-blocks", str(2 * clients * (max_len // 8 + 1)), "--log-level", "warning"]
        if args.no_compile:
            flags.append("--no-compile")
        return ServerProcess(model, flags, env=env, start_timeout=300).start()
    port = free_port()
    exe = Path(sys.executable).parent / "transformers"
    # Its cache sized for the workload, as in `bench --serve` (its default takes 60-90% of free memory).
    command = [str(exe if exe.exists() else "transformers"), "serve", str(model), "--continuous-batching",
               "--device", "cpu", "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
               "--cb-num-blocks", str(4 * clients), "--log-level", "warning"]
    return ServerProcess(model, command=command, env=env, url=f"http://127.0.0.1:{port}", start_timeout=300).start()


def warm_up(server: ServerProcess, system: str, model: str, compile_: bool, timeout: float = 600.0) -> float:
    """One completion (transformers' first request also sets up its batching manager; it gets the
    same extra fields as guidellm's); ours then waits for its compile. Returns the seconds taken."""
    start = time.monotonic()
    # ours starts its compile after COMPILE_AFTER_STEPS engine steps: the warm-up runs that many
    body: dict[str, Any] = {"model": model, "prompt": "A list is", "max_tokens": COMPILE_AFTER_STEPS + 8}
    if system == "transformers":
        body.update({k: v for k, v in TRANSFORMERS_EXTRAS["body"].items() if v is not None})
    else:
        body["ignore_eos"] = True  # all COMPILE_AFTER_STEPS of them
    request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.status == 200, response.status
    if system == "paged" and compile_:
        while not any(marker in line for line in server.log for marker in COMPILED):
            started = any("compiling the model's forward" in line for line in server.log)
            if time.monotonic() - start > (timeout if started else 30):
                break  # no compile began (no C++ compiler, another device), or it takes too long
            time.sleep(0.5)
    return time.monotonic() - start


def guidellm_command(args: argparse.Namespace, system: str, url: str, model: Path, out: Path) -> list[str]:
    backend: dict[str, Any] = {"kind": "openai_http", "target": url, "model": str(model),
                               "request_format": "/v1/completions", "timeout": 600}
    if system == "transformers":
        backend["extras"] = TRANSFORMERS_EXTRAS
    profile = {"kind": "concurrent", "streams": args.levels}
    constraints = [{"kind": "max_requests", "count": [args.requests_per_client * c for c in args.levels]},
                   {"kind": "max_duration", "seconds": [args.max_seconds] * len(args.levels)}]
    data = {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    command = [args.guidellm, "run", "--backend", json.dumps(backend), "--profile", json.dumps(profile),
               "--data", json.dumps(data), "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(model)}),
               "--output", json.dumps({"kind": "json", "path": str(out)}), "--disable-progress"]
    for constraint in constraints:
        command += ["--constraint", json.dumps(constraint)]
    return command


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_guidellm(command: list[str], log: Path, timeout: float, workers: int | None) -> float:
    """Run guidellm (its console output to ``log``); returns its CPU seconds, worker processes included."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    if workers:  # it starts min(streams, 10) worker processes by default
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(workers)
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(True)[-30:])
        raise RuntimeError(f"guidellm exited with {done.returncode}:\n{tail}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark (concurrency level) of a guidellm JSON report."""
    rows = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        totals = m["request_totals"]
        requests = bench["requests"]
        errors = [r["info"].get("error") for r in requests.get("errored") or [] if r.get("info")]
        body = next((json.loads(r["request_args"]).get("body") for r in requests.get("successful") or []
                     if r.get("request_args")), None)
        if body and "prompt" in body:
            body["prompt"] = f"<{len(body['prompt'])} characters>"
        rows.append({
            "concurrency": bench["config"]["strategy"]["streams"],
            "ok": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "duration_s": round(bench["duration"], 2),
            "output_tok_s": round(m["output_tokens_per_second"]["successful"]["mean"], 1),
            "ttft_p50_ms": round(m["time_to_first_token_ms"]["successful"]["median"], 1),
            "ttft_p95_ms": round(m["time_to_first_token_ms"]["successful"]["percentiles"]["p95"], 1),
            "itl_p50_ms": round(m["inter_token_latency_ms"]["successful"]["median"], 2),
            "output_tokens_per_request": round(m["output_token_count"]["successful"]["mean"], 1),
            "prompt_tokens_per_request": round(m["prompt_token_count"]["successful"]["mean"], 1),
            "first_error": errors[0] if errors else None, "body": body,
        })
    return rows


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Request counts summed over the runs; every figure the median of the runs'."""
    out: dict[str, Any] = {k: sum(r[k] for r in runs) for k in ("ok", "errored", "incomplete")}
    for key in ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "output_tokens_per_request"):
        out[key] = round(statistics.median(r[key] for r in runs), 2)
    return out


def format_table(report: dict[str, Any]) -> str:
    results = report["results"]
    lines = [f"guidellm {report['versions']['guidellm']}: model {report['model']}, {report['prompt_tokens']} prompt / "
             f"{report['output_tokens']} output tokens, {report['requests_per_client']} requests per client, "
             f"{report['threads']} threads per server, {report['repeat']} run(s) each",
             f"{'system':<14}{'clients':>8}{'ok/failed':>11}{'out tok/s':>11}{'TTFT p50':>11}{'ITL p50':>10}"
             f"{'tok/req':>9}"]
    for system, levels in results.items():
        for level, s in levels.items():
            failed = s["errored"] + s["incomplete"]
            lines.append(f"{system:<14}{level:>8}{s['ok']:>7}/{failed:<3}{s['output_tok_s']:>11.1f}"
                         f"{s['ttft_p50_ms']:>9.1f}ms{s['itl_p50_ms']:>8.2f}ms{s['output_tokens_per_request']:>9.1f}")
    for level, r in report.get("ratios", {}).items():
        lines.append(f"ours / theirs @{level}: throughput {r['output_tok_s']:.2f}x (per run: "
                     f"{', '.join(f'{x:.2f}' for x in r['per_run'])}), TTFT {r['ttft_p50_ms']:.2f}x, "
                     f"ITL {r['itl_p50_ms']:.2f}x")
    for run_ in report["runs"]:
        lines.append(f"run {run_['run']} {run_['system']}: " + ", ".join(
            f"@{row['concurrency']} {row['output_tok_s']:.0f} tok/s" for row in run_["levels"])
            + f"; server CPU {run_['server_cpu_ms_per_token']:.2f} ms/token, guidellm CPU "
              f"{run_['client_cpu_seconds']:.0f} s, server exit {run_['server_exit_status']}")
    return "\n".join(lines)


def versions(guidellm: str) -> dict[str, str]:
    import torch
    import transformers

    import hf_paged_attn

    done = subprocess.run([guidellm, "--version"], capture_output=True, text=True, timeout=120, check=False)
    return {"guidellm": done.stdout.strip().split()[-1] if done.stdout.strip() else "?",
            "hf_paged_attn": getattr(hf_paged_attn, "__version__", "?"), "transformers": transformers.__version__,
            "torch": torch.__version__, "python": sys.version.split()[0]}


def run(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    args = parse_args(argv, prog)
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = "smoke" if args.smoke else args.model if args.model in ("demo", "random") else Path(args.model).name
    report: dict[str, Any] = {
        "model": args.model, "levels": args.levels, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "requests_per_client": args.requests_per_client,
        "max_seconds": args.max_seconds, "repeat": args.repeat, "threads": args.threads, "dtype": args.dtype,
        "compile": not args.no_compile, "guidellm_workers": args.guidellm_workers, "cpu_count": os.cpu_count(),
        "versions": versions(args.guidellm),
        "loadavg_before": os.getloadavg(), "runs": [],
    }
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        model = model_dir(args.model, Path(scratch))
        for index in range(args.repeat):  # alternate the systems: a shared machine's load drifts
            for system in args.system_list:
                report["runs"].append(one_run(args, system, model, out / f"guidellm_{name}_{system}_{index}", index))
    report["wall_seconds"] = round(time.monotonic() - start, 1)
    report["loadavg_after"] = os.getloadavg()
    add_results(report)
    path = out / f"guidellm_{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"load average before {report['loadavg_before']}, after {report['loadavg_after']}; "
          f"{report['wall_seconds']} s in all; wrote {path}")
    return report


def one_run(args: argparse.Namespace, system: str, model: Path, stem: Path, index: int) -> dict[str, Any]:
    server = start_server(system, model, args)
    try:
        warm = warm_up(server, system, str(model), not args.no_compile)
        assert server.process is not None
        cpu_before = cpu_seconds(server.process.pid)
        timeout = len(args.levels) * args.max_seconds + 300
        client_cpu = run_guidellm(guidellm_command(args, system, server.url, model, stem.with_suffix(".json")),
                                  stem.with_suffix(".log"), timeout, args.guidellm_workers)
        server_cpu = cpu_seconds(server.process.pid) - cpu_before
    except Exception:
        print(f"{system} server log (last lines):\n" + "".join(server.log[-30:]), file=sys.stderr)
        raise
    finally:
        status = server.stop(60)
    rows = summarize(json.loads(stem.with_suffix(".json").read_text()))
    tokens = sum(row["ok"] * row["output_tokens_per_request"] for row in rows)
    return {"system": system, "run": index, "warm_up_seconds": round(warm, 1), "server_exit_status": status,
            "server_cpu_seconds": round(server_cpu, 1), "output_tokens": tokens,
            # all levels together: CPU time is steadier than wall time on a shared machine
            "server_cpu_ms_per_token": round(1000 * server_cpu / tokens, 3) if tokens else None,
            "client_cpu_seconds": round(client_cpu, 1), "levels": rows}


def add_results(report: dict[str, Any]) -> None:
    """``results[system][level]``: medians over the runs; ``ratios[level]``: ours over theirs."""
    by: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for run_ in report["runs"]:
        for row in run_["levels"]:
            by.setdefault(run_["system"], {}).setdefault(row["concurrency"], []).append(row)
    report["results"] = {s: {c: medians(rows) for c, rows in levels.items()} for s, levels in by.items()}
    if set(by) == set(SYSTEMS):
        ours, theirs = report["results"]["paged"], report["results"]["transformers"]
        ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
        report["ratios"] = {
            c: {"output_tok_s": ratio(ours[c]["output_tok_s"], theirs[c]["output_tok_s"]),
                "ttft_p50_ms": ratio(ours[c]["ttft_p50_ms"], theirs[c]["ttft_p50_ms"]),
                "itl_p50_ms": ratio(ours[c]["itl_p50_ms"], theirs[c]["itl_p50_ms"]),
                "per_run": [ratio(a["output_tok_s"], b["output_tok_s"])
                            for a, b in zip(by["paged"][c], by["transformers"][c])]}
            for c in ours if c in theirs
        }


if __name__ == "__main__":
    run()
