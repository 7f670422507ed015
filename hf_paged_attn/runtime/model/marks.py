"""What the runtime puts on a user's model, put there and taken off in one place.

A few things the runtime needs live on the model's own modules, because the model's forward is what
reads them: the compiled forward's layer index buffer on each attention module (``compiled.py``), its
decoder layers' region forwards (``compiled.mark_layer_regions``), and the float32 copies and forwards
of half-precision linears (``fp32_matmuls.py``). The user's model is a guest's house: these marks are
there only while something of ours runs on it, an engine or a background compile. ``ModelMarks`` records
them, per model and outside it (``marks_for``: held weakly, it goes with the model), installs them all
when its first holder opens it and removes them all when its last holder closes: the model is left with
the modules, ``forward``s, buffers and parameters it had.

The records themselves outlive the holders, so a later engine installs the very same objects again: the
same tensors and the same forward callables are what dynamo's guards on the compiled graph look at, so
the graph a first engine compiled serves the next one without a recompile, and the float32 copies are
made once per model.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(slots=True)
class _Mark:
    module: nn.Module
    name: str
    value: object
    buffer: bool  # a non-persistent buffer (else an instance attribute in the module's ``__dict__``)
    installed: bool = False


@dataclass(slots=True)
class ModelMarks:
    """One model's marks and who holds them installed (``open``). Keys are ``(id(module), name)``; the
    marks hold the (sub)modules they sit on, never the model itself: the model's entry in ``_MARKS`` is
    weak, and a mark on the model object would keep it alive."""

    marks: dict[tuple[int, str], _Mark] = field(default_factory=dict)
    num_holders: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)

    def open(self) -> Callable[[], None]:
        """Install every recorded mark (if no holder had); returns the holder's ``close`` (idempotent)."""
        with self.lock:
            self.num_holders += 1
            if self.num_holders == 1:
                for mark in self.marks.values():
                    _install(mark)
        closed = threading.Event()

        def close() -> None:
            with self.lock:
                if closed.is_set():
                    return
                closed.set()
                self.num_holders -= 1
                if self.num_holders == 0:
                    for mark in self.marks.values():
                        _remove(mark)

        return close

    @property
    def is_open(self) -> bool:
        return self.num_holders > 0

    def put(self, module: nn.Module, name: str, value: object, buffer: bool = False) -> None:
        """Record a mark (replacing our own of that name) and install it if the marks are open."""
        with self.lock:
            old = self.marks.get((id(module), name))
            if old is not None:
                _remove(old)
            mark = self.marks[(id(module), name)] = _Mark(module, name, value, buffer)
            if self.is_open:
                _install(mark)

    def get(self, module: nn.Module, name: str) -> object | None:
        mark = self.marks.get((id(module), name))
        return None if mark is None else mark.value

    def forget(self, module: nn.Module, names: tuple[str, ...]) -> None:
        """Remove and forget ``module``'s marks of ``names`` (those it has)."""
        with self.lock:
            for name in names:
                mark = self.marks.pop((id(module), name), None)
                if mark is not None:
                    _remove(mark)

    def forget_all(self, name: str) -> int:
        """Remove and forget every mark called ``name``; returns how many there were."""
        with self.lock:
            keys = [key for key in self.marks if key[1] == name]
            for key in keys:
                _remove(self.marks.pop(key))
            return len(keys)

    def modules_with(self, name: str) -> list[nn.Module]:
        return [mark.module for key, mark in self.marks.items() if key[1] == name]


def _install(mark: _Mark) -> None:
    """Put ``mark`` on its module, unless the module has something of that name of its own (another
    library's forward, say): then the mark stays off, and the module runs as it would without us."""
    module, name = mark.module, mark.name
    if mark.installed or name in module.__dict__ or name in module._buffers:
        return
    if mark.buffer:
        module.register_buffer(name, mark.value, persistent=False)
    else:
        module.__dict__[name] = mark.value
    mark.installed = True


def _remove(mark: _Mark) -> None:
    """Take ``mark`` off its module, if what is there is still ours."""
    if not mark.installed:
        return
    module, name = mark.module, mark.name
    if mark.buffer:
        if module._buffers.get(name) is mark.value:
            del module._buffers[name]
            module._non_persistent_buffers_set.discard(name)
    elif module.__dict__.get(name) is mark.value:
        del module.__dict__[name]
    mark.installed = False


_MARKS: weakref.WeakKeyDictionary[nn.Module, ModelMarks] = weakref.WeakKeyDictionary()
_MARKS_LOCK = threading.Lock()


def marks_for(model: nn.Module) -> ModelMarks:
    """``model``'s marks, made at the first call and kept (weakly, with the model) for later engines."""
    with _MARKS_LOCK:
        found = _MARKS.get(model)
        if found is None:
            found = _MARKS[model] = ModelMarks()
        return found


def tensor_index(idx: int, device: torch.device) -> torch.Tensor:
    """A 0-dim int64 tensor that is never an inference tensor, whatever mode the caller is in: every later
    read of the model's buffers outside ``inference_mode`` (version counters, autograd) would fail on one."""
    with torch.inference_mode(False):
        return torch.tensor(idx, device=device)
