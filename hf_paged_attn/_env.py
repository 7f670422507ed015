"""Environment defaults for the command-line entry points, applied before torch loads.

torch's OpenMP runtime (libgomp) reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when torch is
imported. Its default lets idle worker threads spin for 300,000 rounds (about a millisecond here) before
they sleep; on a shared or oversubscribed CPU the spinning threads steal the cores the work needs, and
the demo's run time swung from 0.5 s to 20 s between runs. ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep
at once, but then waking the second thread costs ~50 us for each of a step's many short parallel
regions, more than it saves on a small model. The commands set ``GOMP_SPINCOUNT=3000`` instead: a
thread spins for the gaps between a step's regions and sleeps between steps. On a quiet 2-core machine,
with the engine's thread tuner (``runtime/cpu/threads.py``), that ran three of the four vs-vLLM rows
1.1-1.5x faster than ``PASSIVE`` (the bundled bf16 row 0.96-1.12x); when another process holds a core
the tuner runs steps on one thread, and the two were within 7% (docs/performance.md, "Adaptive
threads and a short spin").

Only the commands set it (``hf-paged-attn ...``, ``python -m hf_paged_attn.demo`` / ``.bench`` /
``.cli``), and only when the user has set neither variable: ``hf_paged_attn/__init__.py`` imports this
module, which applies them, before it imports anything that imports torch. A library import leaves the
environment alone (by then the caller has usually imported torch, and the process is theirs). For the same
reason only the commands call ``freeze_heap``, once they are set up.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import PurePath

CLI_DEFAULTS = {"GOMP_SPINCOUNT": "3000"}
# Set together or not at all: a user's wait policy or spin count is a choice about the same thing.
OPENMP_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
ENTRY_MODULES = frozenset(
    {"hf_paged_attn.cli", "hf_paged_attn.demo", "hf_paged_attn.serve", "hf_paged_attn_tools.bench"}
)
SCRIPT = "hf-paged-attn"
_OPTIONS_WITH_VALUE = ("-W", "-X")  # interpreter options whose value may be the next argument


def entry_point(orig_argv: Sequence[str]) -> str | None:
    """What the interpreter was asked to run: ``"-m MODULE"``, the script's path, or None (``-c``, stdin).

    ``orig_argv`` is ``sys.orig_argv``: the interpreter's own options come before the module or script.
    """
    args = iter(orig_argv[1:])
    for arg in args:
        if arg == "-" or not arg.startswith("-"):
            return None if arg == "-" else arg  # the script; what follows are its own arguments
        if arg == "--":
            return next(args, None)
        if arg[:2] in _OPTIONS_WITH_VALUE:
            if len(arg) == 2:
                next(args, None)
            continue
        flags = arg[1:]  # short options may be combined: -Bm module, -Im module
        for i, flag in enumerate(flags):
            if flag == "c":
                return None
            if flag == "m":
                return "-m " + (flags[i + 1 :] or next(args, ""))
    return None


def is_cli(orig_argv: Sequence[str]) -> bool:
    """True when the process is one of this package's commands."""
    target = entry_point(orig_argv)
    if target is None:
        return False
    if target.startswith("-m "):
        return target[3:] in ENTRY_MODULES
    return PurePath(target).name.removesuffix(".exe").removesuffix("-script.py") == SCRIPT


def apply_cli_defaults(
    orig_argv: Sequence[str] | None = None, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set :data:`CLI_DEFAULTS` when running a command whose user set neither of ``OPENMP_WAITING`` (or
    left them empty); returns what was set."""
    orig_argv = sys.orig_argv if orig_argv is None else orig_argv
    environ = os.environ if environ is None else environ
    if not is_cli(orig_argv):
        return {}
    if any(environ.get(k) for k in OPENMP_WAITING):  # empty: OpenMP's default, not a choice
        return {}
    applied = dict(CLI_DEFAULTS)
    environ.update(applied)
    return applied


APPLIED = apply_cli_defaults()  # what this process got from CLI_DEFAULTS (the demo reports it)


def freeze_heap() -> int:
    """Collect, then move every object alive now out of the cyclic collector's reach (``gc.freeze``); returns how
    many objects are frozen.

    A full (generation 2) collection walks every object the process holds: with torch and transformers imported
    and the demo model loaded, 190-200 ms (``gc.collect()`` timed three times), and Python runs one whenever the
    objects that survived into the oldest generation have grown by a quarter since the last. A server saw one
    every few batches of requests, each a quarter-second stall of every request running (``python
    benchmarks/structured_serve.py``: one round in five 0.5-0.6x the others). Frozen, the objects of start-up are
    never walked again: collections then took 1-5 ms. vLLM freezes its engine's heap after its warm-up the same
    way. Only processes that are ours call it (the server once it has loaded and compiled, a benchmark's client
    before its timed rounds): a frozen object is still freed when its last reference goes, but a reference cycle
    among frozen objects is never collected, which a library must not impose on its caller's process.

    At exit the objects are unfrozen, so that the interpreter's last collection frees them: libraries bound with
    nanobind (triton's, imported with torch) otherwise report each of theirs still alive as a leak on stderr.
    """
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()
