"""The checks in run order: parity checks first, newest code first among them (a run cut short by its
time limit still says whether the code is right), then the figures-only measurements, longest last.
The names and their order are those of every earlier GPU run, so logs read alike.

Each module of ``checks/`` holds one check (or one family: a check per backend, dtype or mode) and
lists it in its ``CHECKS``; ``load_checks`` imports them all and orders them by ``ORDER``.
"""

from __future__ import annotations

import dataclasses
import importlib

from .base import Check

ORDER = (
    "lora/kernels",
    "lora/engine-fp32",
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
    "speculative/fp32",
    "prompt-logprobs/fp32",
    "structured/fp32",
    "window/bf16/flash",
    "bandwidth/triton",
    "bandwidth/flash",
    "bandwidth/torch",
    "splitk/bf16",
    "graphs/bf16",
    "e2e/bf16",
    "throughput/bf16",
)
MODULES = (
    "lora",
    "kernels",
    "greedy",
    "graphs_parity",
    "e2e_parity",
    "cascade",
    "mixed",
    "features",
    "windows",
    "bandwidth",
    "splitk",
    "graphs_throughput",
    "e2e_throughput",
    "throughput",
)


def load_checks() -> list[Check]:
    """Every check of ``MODULES``, in ``ORDER``; raises if a module's names and ``ORDER`` disagree."""
    found: dict[str, Check] = {}
    package = __name__.rpartition(".")[0]
    for name in MODULES:
        module = importlib.import_module(f"{package}.checks.{name}")
        for check in module.CHECKS:
            if check.name in found:
                raise RuntimeError(f"{check.name!r} is defined by {found[check.name].module} and {module.__name__}")
            found[check.name] = dataclasses.replace(check, module=module.__name__)
    if set(found) != set(ORDER):
        raise RuntimeError(
            f"checks without a place in ORDER: {sorted(set(found) - set(ORDER))}; "
            f"names in ORDER that no module defines: {sorted(set(ORDER) - set(found))}"
        )
    return [found[name] for name in ORDER]
