"""An older torch backend, loaded from a file, for side-by-side runs in one process.

    git show REV:hf_paged_attn/kernels/torch_backend.py > /tmp/torch_backend_old.py

``engines_use(module)`` makes every ContinuousBatchingEngine built inside it (``model.generate``
builds one per call) call ``module`` instead of the backend it resolved; the model, the engine and
everything else stay the same. Used by ``demo_generate.py`` and ``rounds.py`` (``--baseline-backend``).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from types import ModuleType

from hf_paged_attn.runtime.engine import ContinuousBatchingEngine


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_backend_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def engines_use(module: ModuleType) -> Iterator[None]:
    original = ContinuousBatchingEngine.__init__

    def init(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        original(self, *args, **kwargs)
        self.backend = module

    ContinuousBatchingEngine.__init__ = init
    try:
        yield
    finally:
        ContinuousBatchingEngine.__init__ = original
