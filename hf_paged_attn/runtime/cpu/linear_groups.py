"""Projections that read the same input as one matmul (q/k/v, gate/up), in the CPU's compiled forward.

A decoder layer multiplies one normed hidden state by q_proj, k_proj and v_proj, and another by gate_proj
and up_proj. At a decode step's few dozen rows the small k/v projections leave oneDNN too little work to
share between threads: a whole step's matmuls of the 30M Llama took 18.3 ms grouped against 22.7 ms
(bf16, 64 rows, 2 threads, an AMD EPYC; ``benchmarks/linear_backends_cpu.py``). vLLM's models fuse these
layers when they load; this module does it without touching the model, in the compiled graph only:

- ``GroupLinears``, an inductor post-grad pass (run by ``sampled_rows.SAMPLED_ROWS``, the pass of
  ``compiled.inductor_options``), finds the ``hf_paged_attn::packed_linear`` calls that share their
  input and replaces them with one
  ``hf_paged_attn::packed_linear_group`` call, whose output columns are sliced back into the members';
- the op multiplies by one packed copy of the members' weights concatenated (``_group_copy``), made the
  first time it runs (the compile's warm-up step) from weights ``packed_linear.pack`` packed, whose
  single copies it then drops (the graph no longer reads them). Whenever a member is not exactly the
  tensor concatenated (replaced, updated in place) it computes each member's ``packed_linear`` instead:
  never a stale result.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

from ...torch_private import CustomGraphPass, get_hash_for_files, linear_pointwise, reorder_linear_weight
from ..model.weights import fingerprint, version_of
from . import packed_linear as packing


@dataclass(frozen=True, slots=True)
class _Group:
    """The members' weights concatenated along their output features and packed, their biases concatenated."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    made_of: tuple[int, int]  # the members' weights' and biases' ``fingerprint`` when made
    layouts: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]  # each weight's shape, stride, dtype
    sources: tuple[weakref.ReferenceType[torch.Tensor], ...]  # the very weights concatenated
    versions: tuple[int, ...]  # and their version counters then (``_quick``)
    pointers: tuple[int, ...]  # and data pointers (``p.data = new`` keeps the object, moves the pointer)
    biased: bool  # a member has a bias (``_quick`` then leaves the check to ``_holds``)


# The members' weights' ids -> their group copy; every use checks the members are the very tensors
# (``sources``), and the entry goes with the first of them freed (``_drop``).
_GROUPS: dict[tuple[int, ...], _Group] = {}
# id(first member's weight) -> its group: the graph passes the same weight objects at every call, and this
# finds their group with the fewest Python steps (``_quick``; a step's caches are cold between matmuls).
_BY_FIRST: dict[int, _Group] = {}
_MAKING = threading.Lock()  # two engines' steps may meet a group's first call at once


def _layouts(weights: list[torch.Tensor]) -> tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(w.shape), w.stride(), w.dtype) for w in weights)


def _holds(entry: _Group | None, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> bool:
    """Whether ``entry`` was made from exactly these members, unchanged since."""
    if entry is None or len(entry.sources) != len(weights):
        return False
    if any(ref() is not w for ref, w in zip(entry.sources, weights)):
        return False
    return entry.made_of == fingerprint([*weights, *biases]) and entry.layouts == _layouts(weights)


def _quick(entry: _Group | None, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> bool:
    """Whether ``entry`` was made of exactly the tensors ``weights``, each at its version then, without biases."""
    if entry is None or entry.biased or len(entry.sources) != len(weights):
        return False
    for ref, version, pointer, w, b in zip(entry.sources, entry.versions, entry.pointers, weights, biases):
        if ref() is not w or version_of(w) != version or w.data_ptr() != pointer or b is not None:
            return False
    return True


def _forget(entry: _Group | None) -> None:
    """Drops ``entry`` from ``_BY_FIRST`` (``_GROUPS`` is its callers' to clear)."""
    for first in [first for first, found in _BY_FIRST.items() if found is entry]:
        del _BY_FIRST[first]


def _drop(key: tuple[int, ...], entry: _Group) -> None:
    """Forgets ``entry`` when one of its weights is freed (unless a newer copy took its key)."""
    if _GROUPS.get(key) is entry:
        del _GROUPS[key]
    _forget(entry)


def _make(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> _Group:
    cat = torch.cat([w.detach() for w in weights])  # [sum(out_features), in_features]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
    packed = reorder_linear_weight(cat, packing.PACK_ROWS)
    made_of = fingerprint([*weights, *biases])
    sources, versions = tuple(weakref.ref(w) for w in weights), tuple(version_of(w) for w in weights)
    pointers = tuple(w.data_ptr() for w in weights)
    return _Group(packed, bias, made_of, _layouts(weights), sources, versions, pointers, bias is not None)


def _group_copy(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> _Group | None:
    """The members' group copy, made now if every member's single packed copy still holds (``pack`` took
    them, so they are wanted and fit); None when it can't be had (then each member runs on its own)."""
    key = tuple(map(id, weights))
    entry = _GROUPS.get(key)
    if not _holds(entry, weights, biases):
        with _MAKING, torch.inference_mode():
            entry = _GROUPS.get(key)
            if not _holds(entry, weights, biases):
                if any(packing._lookup(w) is None for w in weights):
                    return None
                entry = _GROUPS[key] = _make(weights, biases)
                for w in weights:
                    weakref.finalize(w, _drop, key, entry)
                    packing._PACKED.pop(id(w), None)  # the graph multiplies by the group's copy instead
    if not entry.biased:
        _BY_FIRST[id(weights[0])] = entry
    return entry


def unpack(model: torch.nn.Module) -> None:
    """Drops the group copies of ``model``'s weights (the op then runs each member on its own)."""
    ids = {id(w) for w in packing._weights(model)}
    for key in [key for key in _GROUPS if ids.intersection(key)]:
        _forget(_GROUPS.pop(key, None))


def _packed_linear_group(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> torch.Tensor:
    """``cat([F.linear(x, w, b) for each member], -1)``, as one matmul on the members' group copy."""
    entry = _BY_FIRST.get(id(weights[0]))
    if x.dtype == weights[0].dtype and _quick(entry, weights, biases):  # the graph's usual call: its very weights
        return linear_pointwise(x, entry.packed, None)
    entry = _group_copy(weights, biases) if all(w.dtype == x.dtype for w in weights) else None
    if entry is None or (entry.bias is not None and entry.bias.dtype != x.dtype):
        return torch.cat([packing.packed_linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
    return linear_pointwise(x, entry.packed, entry.bias)


def _packed_linear_group_fake(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]):  # noqa: ANN202
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


_LIB = torch.library.Library("hf_paged_attn", "FRAGMENT")
_LIB.define("packed_linear_group(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")
_LIB.impl("packed_linear_group", _packed_linear_group, "CPU")
torch.library.register_fake("hf_paged_attn::packed_linear_group", _packed_linear_group_fake, lib=_LIB)
packed_linear_group = torch.ops.hf_paged_attn.packed_linear_group.default


def _groupable(nodes: list[torch.fx.Node], order: dict[torch.fx.Node, int]) -> bool:
    """Whether ``packed_linear`` calls on one input can become one call placed at the first of them: weights
    of one dtype and input size, every weight and bias defined before that first call."""
    weights = [n.args[1] for n in nodes]
    vals = [w.meta.get("val") if isinstance(w, torch.fx.Node) else None for w in weights]
    if any(v is None or v.dim() != 2 for v in vals) or len({(v.dtype, v.shape[1]) for v in vals}) != 1:
        return False
    first = min(order[n] for n in nodes)
    inputs = [a for n in nodes for a in n.args[1:3] if isinstance(a, torch.fx.Node)]
    return all(order[a] < first for a in inputs)


class GroupLinears(CustomGraphPass):
    """Inductor post-grad pass: ``packed_linear`` calls that share their input become one
    ``packed_linear_group`` call and a slice of its columns for each (see the module's docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        by_input: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            if node.op == "call_function" and node.target is packing.packed_linear and len(node.args) == 3:
                by_input[node.args[0]].append(node)
        for x, nodes in by_input.items():
            if len(nodes) > 1 and _groupable(nodes, order):
                self._group(graph, x, sorted(nodes, key=order.__getitem__))

    @staticmethod
    def _group(graph: torch.fx.Graph, x: torch.fx.Node, nodes: list[torch.fx.Node]) -> None:
        weights, biases = [n.args[1] for n in nodes], [n.args[2] for n in nodes]
        sizes = [w.meta["val"].shape[0] for w in weights]
        with graph.inserting_before(nodes[0]):
            fused = graph.call_function(packed_linear_group, (x, weights, biases))
            fused.meta["val"] = _packed_linear_group_fake(x.meta["val"], [w.meta["val"] for w in weights], [])
            start = 0
            for node, size in zip(nodes, sizes):  # each member's columns: a view, as split's pieces would be
                part = graph.call_function(torch.ops.aten.slice.Tensor, (fused, -1, start, start + size))
                part.meta["val"] = fused.meta["val"][..., start : start + size]
                node.replace_all_uses_with(part)
                start += size
        for node in nodes:  # only now: the parts were inserted before the first of them
            graph.erase_node(node)

    def uuid(self) -> bytes:  # inductor's disk cache keys graphs on it: one compiled with groups is not one without
        return get_hash_for_files((__file__,))


GROUP_LINEARS = GroupLinears()
