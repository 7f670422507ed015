"""Every backend conforms to ``kernels.base.AttentionBackend``: no abstract method left, the entry
points take the protocol's parameters in its order (extras only keyword-only with defaults), and
the capabilities are declared with the right types."""

from __future__ import annotations

import inspect

import pytest
import torch

from hf_paged_attn.kernels import BACKENDS
from hf_paged_attn.kernels.base import AttentionBackend

ENTRY_POINTS = ("write_kv", "paged_prefill_attention", "paged_decode_attention", "decode_layers")  # the last optional


def parameters(function: object) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())


def conforms(backend: type[AttentionBackend]) -> list[str]:
    """What is wrong with ``backend``'s entry points, as readable lines (empty: it conforms)."""
    problems = []
    instance = backend()
    for name in ENTRY_POINTS:
        want = parameters(getattr(AttentionBackend, name))[1:]  # without self
        got = parameters(getattr(instance, name))
        for expected, actual in zip(want, got):
            if (expected.name, expected.kind, expected.default) != (actual.name, actual.kind, actual.default):
                problems.append(f"{name}: {actual} where the protocol has {expected}")
        if len(got) < len(want):
            problems.append(f"{name}: missing {[p.name for p in want[len(got):]]}")
        for extra in got[len(want) :]:
            if extra.kind is not inspect.Parameter.KEYWORD_ONLY or extra.default is inspect.Parameter.empty:
                problems.append(f"{name}: extra parameter {extra} must be keyword-only with a default")
    return problems


@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_conforms_to_the_protocol(name: str) -> None:
    backend = BACKENDS[name]
    assert issubclass(backend, AttentionBackend) and backend.name == name
    assert not backend.__abstractmethods__, f"{name} leaves {sorted(backend.__abstractmethods__)} abstract"
    assert conforms(backend) == []
    assert isinstance(backend.graph_safe, bool) and isinstance(backend.supports_sinks, bool)
    assert backend.dtypes is None or all(isinstance(d, torch.dtype) for d in backend.dtypes)
    assert isinstance(backend.block_size_rule, str) and backend.block_size_rule
    assert backend.accepts_block_size(backend.default_block_size(torch.device("cpu")))
    assert isinstance(backend.is_available(torch.device("cpu")), bool)


def test_the_conformance_check_can_fail() -> None:
    class Drifted(BACKENDS["torch"]):
        def paged_decode_attention(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, *, softmax_scale,
                                   num_splits):  # fmt: skip
            raise AssertionError("never called")

    problems = conforms(Drifted)
    assert any("max_seqlen_k" in p for p in problems) and any("num_splits" in p for p in problems)
