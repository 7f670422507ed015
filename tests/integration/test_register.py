"""The process-wide patches live in ``integration/register.py``, each installed once when a compile first
needs it and each with an undo that puts back what was there."""

from __future__ import annotations

import atexit

import pytest
import torch
import torch._dynamo

from hf_paged_attn.integration import register
from hf_paged_attn.runtime.cpu import compiled
from hf_paged_attn.runtime.cpu.patches import COMPILE_PATCHES, install_compile_patches


@pytest.fixture
def unpatched():
    """Every patch undone for the test, and put back after it as it was."""
    had = [name for name in register.PATCHES if register.undo_patch(name)]
    yield
    for name in had:
        register.patch(name)


def test_the_runtime_asks_registration_for_its_patches() -> None:
    register.register()
    assert COMPILE_PATCHES.count(register.install_compile_patches) == 1


def test_the_fx_trace_lock_and_its_undo(unpatched) -> None:
    original = torch.fx.Tracer.__dict__["trace"]
    register.patch("fx_trace_lock")
    register.patch("fx_trace_lock")  # once
    patched = torch.fx.Tracer.__dict__["trace"]
    assert patched is not original and patched.holds_fx_trace_lock and patched.__wrapped__ is original
    assert torch.fx.symbolic_trace(torch.nn.Linear(2, 2)).graph is not None  # still traces
    assert register.undo_patch("fx_trace_lock") and not register.undo_patch("fx_trace_lock")
    assert torch.fx.Tracer.__dict__["trace"] is original


def test_the_recompile_limit_and_its_undo(unpatched) -> None:
    config = torch._dynamo.config
    original = config.recompile_limit
    try:
        config.recompile_limit = 8
        register.patch("recompile_limit")
        assert config.recompile_limit == compiled.RECOMPILE_LIMIT
        register.undo_patch("recompile_limit")
        assert config.recompile_limit == 8
    finally:
        config.recompile_limit = original


def test_the_wait_at_exit_and_its_undo(unpatched, monkeypatch) -> None:
    registered, unregistered = [], []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    register.patch("wait_at_exit")
    assert registered == [compiled.wait_for_compiles_at_exit]
    register.undo_patch("wait_at_exit")
    assert unregistered == [compiled.wait_for_compiles_at_exit]


def test_a_compile_installs_every_patch(unpatched) -> None:
    register.register()
    install_compile_patches()
    assert set(register._UNDO) == set(register.PATCHES)
