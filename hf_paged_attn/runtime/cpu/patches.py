"""The process-wide patches the runtime needs, which it never makes itself.

A compiled forward (``compiled.py``) needs torch patched for the whole process: torch.fx's tracer holding
the compile's lock, dynamo's recompile limit raised, a wait at exit for a compile still running.
``integration/register.py``, the one module that patches anything, adds its installer to
``COMPILE_PATCHES`` (as ``register()`` runs, at import); the runtime calls it before a model's first
compile (``install_compile_patches``), and the registration module keeps each patch's undo.
"""

from __future__ import annotations

from collections.abc import Callable

COMPILE_PATCHES: list[Callable[[], None]] = []  # installers, each idempotent


def install_compile_patches() -> None:
    """Install every patch a compile needs (each at most once: the installers are idempotent)."""
    for install in COMPILE_PATCHES:
        install()
