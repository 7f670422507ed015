"""``hf-paged-attn`` command line: ``bench`` and ``demo`` subcommands.

    hf-paged-attn bench --smoke
    hf-paged-attn bench --workload uniform --out benchmarks/results --systems engine,hf_cb
    hf-paged-attn demo --num-prompts 8

Everything after the subcommand is passed to it unchanged (``hf-paged-attn bench --help``).
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "bench": "benchmark the engine against transformers' continuous batching and padded generate",
    "demo": "stream completions from the bundled demo model",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hf-paged-attn`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="hf-paged-attn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args, rest = parser.parse_known_args(argv[:1])
    rest += argv[1:]
    if args.command == "bench":
        from .bench import main as bench_main

        bench_main(rest)
    else:
        from .demo import main as demo_main

        demo_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
