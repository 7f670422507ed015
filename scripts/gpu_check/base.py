"""What a check is and what it is given: ``Check`` (a name, a function, a time budget), the outcomes
other than PASS (``Skip``, ``Fail``), and ``Context``, the run's shared state (device, backends, the
tiny model every greedy check loads).

A check's function takes the ``Context`` and returns its PASS line's detail; it raises ``Skip`` for
SKIPPED, ``Fail`` for a FAIL whose detail says it all (no traceback), any other exception for a FAIL
with a traceback on stderr. Nothing here imports a check module, so the check modules import it.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_paged_attn.kernels.base import AttentionBackend

BACKEND_NAMES = ("triton", "flash", "torch")


class Skip(Exception):
    """The check cannot run here (no backend, no CUDA): SKIPPED with this reason."""


class Fail(Exception):
    """The check ran and its result is wrong: FAIL with this detail, no traceback."""


@dataclass(frozen=True)
class Check:
    """One line of the report. ``run(context)`` returns the PASS detail. ``budget_s``: seconds it may
    take before it is stopped and marked FAIL (the run goes on with the next check). ``cpu``: it has a
    CPU variant (``--device cpu``: tiny shapes, Triton through its interpreter). ``uses``: the
    package APIs it calls that its imports do not show (attributes, keyword parameters), resolved by
    ``--dry-run`` (``apis.py`` for the format)."""

    name: str
    run: Callable[[Context], str]
    budget_s: float
    cpu: bool = False
    uses: tuple[str, ...] = ()
    module: str = ""  # the check module's name, filled in by the registry


@dataclass
class Context:
    """What every check of one run shares. ``device``: where the checks run (``cuda`` on a GPU
    machine, ``cpu`` for the dry runs); ``tiny``: shapes and workloads small enough for the CPU."""

    device: torch.device
    tiny: bool = False
    workdir: str | None = None  # made at the first ``subdir``; the run removes it at its end
    _backends: dict[str, AttentionBackend | str] = field(default_factory=dict)
    _tiny_llama: str | BaseException | None = None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def subdir(self, prefix: str) -> str:
        """A fresh directory under this run's work directory (models are saved there)."""
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="gpu_check_")
        return tempfile.mkdtemp(prefix=prefix, dir=self.workdir)

    def backend_or_reason(self, name: str) -> AttentionBackend | str:
        """``name``'s backend instance on this run's device, or why it is unavailable."""
        if name not in self._backends:
            self._backends[name] = _load_backend(name, self.device)
        return self._backends[name]

    def backend(self, name: str) -> AttentionBackend:
        """``name``'s backend instance; raises ``Skip`` when it is unavailable here."""
        found = self.backend_or_reason(name)
        if isinstance(found, str):
            raise Skip(f"backend unavailable ({found})")
        return found

    def available(self, *names: str) -> list[str]:
        """The backends of ``names`` that can run here, in that order."""
        return [n for n in names if not isinstance(self.backend_or_reason(n), str)]

    def tiny_llama(self) -> str:
        """The directory of the tiny random Llama every greedy check loads, built once per run (2
        layers instead of 4 on the CPU: the Triton interpreter takes ~0.3 s per decode call)."""
        if self._tiny_llama is None:
            from .helpers import tiny_llama_dir

            try:
                self._tiny_llama = tiny_llama_dir(self.subdir("llama_"), num_layers=2 if self.tiny else 4)
            except Exception as exc:  # every check that needs it fails with this, not only the first
                self._tiny_llama = exc
        if isinstance(self._tiny_llama, BaseException):
            raise RuntimeError(f"the tiny model could not be built: {self._tiny_llama!r}") from self._tiny_llama
        return self._tiny_llama


def _load_backend(name: str, device: torch.device) -> AttentionBackend | str:
    """An instance of backend ``name`` that can run on ``device``, or the reason it cannot (its import
    error, or what it needs): the backends import their kernels lazily, so they are imported here."""
    from hf_paged_attn import kernels

    try:
        if name == "flash":
            kernels.flash_backend._load_flash_attn()  # flash_attn is imported at first use: try it now
        elif name == "triton":
            importlib.import_module("hf_paged_attn.kernels.triton_ops")
        cls = kernels.BACKENDS[name]
        if not cls.is_available(device):
            return f"kernel={name!r} {cls.install_hint}; the check runs on {device}"
        return kernels.load_backend(name, device)
    except Exception as exc:  # report whatever made it unavailable
        from .helpers import short_error

        return short_error(exc)


def interpreting_triton() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
