"""The hf-paged-attn command: bench, demo and serve subcommands.

    hf-paged-attn demo --num-prompts 8
    hf-paged-attn bench --smoke
    hf-paged-attn bench --workload uniform --out results --systems engine,hf_cb
    hf-paged-attn serve --help              (needs the [serve] extra)

Everything after the subcommand is passed to it unchanged: hf-paged-attn COMMAND --help.
The command sets GOMP_SPINCOUNT=3000 (a short spin before OpenMP threads sleep) unless the environment
sets OMP_WAIT_POLICY or GOMP_SPINCOUNT (see the README).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from . import __version__

COMMANDS = {
    "bench": "benchmark the engine against transformers' continuous batching and padded generate (from a "
    "source checkout)",
    "demo": "stream completions from the bundled demo model",
    "serve": "OpenAI-compatible HTTP server (needs: pip install 'hf-paged-attn[serve]')",
}


# The benchmarks (hf_paged_attn_tools) are tooling, not the runtime: they stay out of the wheel.
BENCH_NEEDS_CHECKOUT = (
    "hf-paged-attn bench runs from a source checkout: the benchmarks (hf_paged_attn_tools) are not part of the "
    "installed package. Clone the project's repository, then in it: pip install -e . && hf-paged-attn bench ..."
)


def checkout_root() -> Path:
    """The folder that holds this package: a source checkout's root when it is one (an editable install)."""
    return Path(__file__).resolve().parent.parent


def bench_main() -> Callable[..., object]:
    """The bench command's ``main``: importable from the checkout (the current directory, or the one an
    editable install points at, whose package list leaves the tools out); SystemExit saying what to do elsewhere."""
    try:
        from hf_paged_attn_tools.bench.command import main
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("hf_paged_attn_tools"):
            raise
        root = checkout_root()
        if not (root / "hf_paged_attn_tools" / "bench" / "command.py").is_file():
            raise SystemExit(BENCH_NEEDS_CHECKOUT) from None
        sys.path.insert(0, str(root))
        from hf_paged_attn_tools.bench.command import main
    return main


def build_parser() -> argparse.ArgumentParser:
    commands = "\n".join(f"  {name:<8}{text}" for name, text in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="hf-paged-attn",
        description=__doc__,
        epilog=f"commands:\n{commands}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="bench, demo or serve")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hf-paged-attn`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    prog = f"hf-paged-attn {args.command}"
    if args.command == "bench":
        bench_main()(args.args, prog=prog)
        return 0
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(args.args, prog=prog)
        return 0
    return serve(args.args)


def serve(argv: list[str]) -> int:
    """``hf-paged-attn serve``: forwards to ``hf_paged_attn.serve.cli.main``, imported only now."""
    try:
        from .serve.cli import main as serve_main
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "hf_paged_attn":
            print(f"hf-paged-attn serve: this installation has no server ({exc.name} is missing)", file=sys.stderr)
        else:  # a dependency of the [serve] extra
            print(
                f"hf-paged-attn serve needs the [serve] extra ({exc.name} is not installed): "
                "pip install 'hf-paged-attn[serve]'",
                file=sys.stderr,
            )
        return 1
    status = serve_main(argv)
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
