"""What a generation call does to the model around it: runs it in eval mode, leaves it as found.

An RL loop (TRL's ``GRPOTrainer``) generates between training steps with the model in training
mode, then calls ``model.train()`` itself. transformers' continuous-batching manager switches the
model to eval (dropout off) for its engine; ours does the same for every call that runs the engine,
and puts back the training flag and the attention implementation afterwards, so the caller's next
forward is exactly the one it would have run.

``weights_version`` fingerprints the weights (each parameter's storage and in-place version) for
state kept across calls (a persistent manager): a weight replaced (``p.data = new``) or updated in
place by torch ops (an optimizer step, ``load_state_dict``, ``p.add_`` under ``no_grad``) changes it.
Writes through ``p.data`` bypass the version counter, so nothing that depends on the weights'
*values* (prefix-cache entries) is kept across calls whatever the fingerprint says.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .. import transformers_private as hf


@contextmanager
def generation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode inside; the training flag of every module and the attention implementation as they were after."""
    training = [(module, module.training) for module in model.modules()]
    attn = hf.attn_implementation(model)
    model.eval()
    try:
        yield
    finally:
        for module, flag in training:
            module.training = flag
        if hf.attn_implementation(model) != attn and attn is not None:
            model.set_attn_implementation(attn)


def weights_version(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """(data pointer, in-place version) of every parameter and buffer, in module order."""
    tensors = [*model.parameters(), *model.buffers()]
    # torch's in-place version counter, read by name: ``._version`` is also a transformers attribute,
    # which the architecture test keeps to transformers_private.py
    return tuple((t.data_ptr(), getattr(t, "_version")) for t in tensors)  # noqa: B009
