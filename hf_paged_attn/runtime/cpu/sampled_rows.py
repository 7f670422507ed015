"""Only the sampled rows after the last attention, in the CPU's compiled forward.

A step's logits are taken at a few rows (``logits_indices``: each request's last token), but a decoder
computes every row to the end: in a prefill step of 512 prompt tokens with 4 requests sampled, the last
layer's output projection and MLP run 508 rows nobody reads (the layer's keys and values are needed for
every row; nothing after its attention is). In the 30M Llama that is 11% of a prefill step's matmuls.
vLLM computes them too (its ``logits_indices`` select rows after the final norm, as transformers'
``logits_to_keep`` does).

``SampledRows``, an inductor post-grad pass (``compiled.inductor_options``; it then runs
``linear_groups.GROUP_LINEARS``), moves the row selection up the graph: ``index(f(x), rows)`` becomes
``f(index(x, rows))`` for every op ``f`` that computes each row from that row alone (``_Mover._through``:
pointwise ops, their operands broadcast along the rows kept whole; reductions, ``var_mean`` and slices
along other dims; reshapes that keep a row's elements together; the packed projections, ``mm``,
``addmm``). It stops at an op it cannot see through (the last attention) and at a result something else
also reads whole (the last layer's input, which its keys need), and selects the rows from that result
instead: the moves are planned first, and only ops whose every reader moves too are rebuilt, so nothing
is computed twice. The ops the selection no longer reads are then dead, and go. Each kept row goes
through the same ops as before, on the same values; only the matmuls' row counts change (the pass on and
off gave the same greedy tokens on every model tried: ``tests/runtime/cpu/test_sampled_rows.py``,
``benchmarks/sampled_rows_ab.py``).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import Graph, Node

from ...torch_private import CustomGraphPass, detect_fake_mode, get_hash_for_files
from . import linear_groups
from . import packed_linear as packing

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# Ops whose every output element depends only on the same-position elements of their tensor operands
# (which broadcast): the row selection moves to the operands that carry the row dim.
POINTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor, aten.neg.default, aten.exp.default, aten.rsqrt.default, aten.sqrt.default,
    aten.sigmoid.default, aten.tanh.default, aten.silu.default, aten.gelu.default, aten.relu.default,
    aten.abs.default, aten.reciprocal.default, aten.log.default, aten.erf.default, aten.maximum.default,
    aten.minimum.default, aten.where.self, aten.clamp.default, aten.clone.default, aten.add.Scalar,
    aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.exp2.default, aten.expm1.default,
    aten.log1p.default, aten.sign.default, aten.masked_fill.Scalar,
    torch.ops.prims.convert_element_type.default, aten._to_copy.default,
}  # fmt: skip
# Reductions over the dims their second argument names (kept or dropped): row-wise when the row dim is
# not one of them.
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction}
# Reductions with more than one result (a LayerNorm's statistics), read through ``getitem``.
TUPLE_REDUCTIONS = {aten.var_mean.correction}
RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


def _val(node: object) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _same(a: object, b: object) -> bool:
    """Whether two sizes are the same symbol (or the same number), without guarding on either."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return isinstance(a, int) and isinstance(b, int) and a == b


def _has_rows(node: object, dim: int, rows: object) -> bool:
    """Whether ``node`` is a tensor whose dim ``dim`` (counted from the end when negative) is the rows."""
    value = _val(node)
    return value is not None and -value.dim() <= dim < value.dim() and _same(value.shape[dim], rows)


class _Mover:
    """Builds ``x[rows along dim]`` for nodes of one graph, moving the selection above row-wise ops."""

    def __init__(self, graph: Graph, index: Node, rows_node: Node, rows: object) -> None:
        self.graph, self.index, self.rows_node = graph, index, rows_node
        self.rows = rows  # the graph's row count (a SymInt)
        self.fake_mode = detect_fake_mode([_val(index)])
        self.done: dict[tuple[Node, int], Node] = {}
        self.count: Node | None = None  # the selected row count, where a reshape names it
        self.moved: set[Node] = set()  # ops computed on the selected rows only (planned, then built)
        # A first pass only plans (``planning``): which ops the selection could move above. ``allowed`` then
        # keeps those whose every result is read by the selection alone; an op whose result some other op
        # also reads (the last layer's input, which its keys and values need whole) is computed whole
        # anyway, so its rows are selected from it instead of computed twice.
        self.planning = True
        self.allowed: set[Node] | None = None

    def count_node(self) -> Node:
        if self.planning:
            return self.rows_node  # a stand-in: nothing is built while planning
        if self.count is None:
            with self.graph.inserting_before(self.index):
                self.count = self.graph.call_function(aten.sym_size.int, (self.rows_node, 0))
            self.count.meta["val"] = _val(self.rows_node).shape[0]
        return self.count

    def select(self, node: Node, dim: int) -> Node:
        """A node of ``node`` with only the selected rows along ``dim`` (< 0: from the end)."""
        key = (node, dim)
        if key not in self.done:
            moved = self._through(node, dim)
            self.done[key] = moved if moved is not None else self._gather(node, dim)
        return self.done[key]

    def restrict(self) -> None:
        """From planning to building: only the planned ops whose every user is moved too (or the selection)."""
        allowed = set(self.moved)
        changed = True
        while changed:
            changed = False
            for node in list(allowed):
                if any(user is not self.index and user not in allowed for user in node.users):
                    allowed.discard(node)
                    changed = True
        self.planning, self.allowed, self.moved, self.done = False, allowed, set(), {}

    def _gather(self, node: Node, dim: int) -> Node:
        if self.planning:
            return node
        ndim = _val(node).dim()
        indices = [None] * (dim % ndim) + [self.rows_node]
        return self._make(aten.index.Tensor, (node, indices), {}, after=node)

    def _make(self, target: object, args: tuple, kwargs: dict, after: Node) -> Node:
        if self.planning:
            return after
        # Placed right before the index it replaces: every operand (the graph's inputs, the selected rows
        # and any op of the chain) is defined by then.
        with self.graph.inserting_before(self.index):
            node = self.graph.call_function(target, args, kwargs)
        fake_args = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
        fake_kwargs = torch.fx.node.map_arg(kwargs, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def _through(self, node: Node, dim: int) -> Node | None:
        """``node``'s op on its operands' selected rows, or None where it is not row-wise along ``dim``."""
        if node.op != "call_function" or not _has_rows(node, dim, self.rows):
            return None
        if self.allowed is not None and node not in self.allowed:
            return None
        target, args, kwargs = node.target, node.args, node.kwargs
        out = _val(node)
        if target in POINTWISE:

            def operand(a: object) -> object:
                value = _val(a)
                if value is None:
                    return a
                at = dim - out.dim() if dim >= 0 else dim  # broadcasting aligns dims from the end
                if -value.dim() <= at and _same(value.shape[at], self.rows):
                    return self.select(a, at)
                if -value.dim() <= at and not _same(value.shape[at], 1):
                    raise _NotRowWise
                return a  # broadcast along the rows (a weight, a scalar tensor)

            try:
                new_args = tuple(operand(a) for a in args)
                new_kwargs = {k: operand(v) for k, v in kwargs.items()}
            except _NotRowWise:
                return None
        elif target in REDUCTIONS:
            row = dim % out.dim()
            if not _reduces_beside(node, row):
                return None
            new_args, new_kwargs = (self.select(args[0], row), *args[1:]), dict(kwargs)
        elif target is operator.getitem and isinstance(args[0], Node) and args[0].target in TUPLE_REDUCTIONS:
            results = self._results(args[0], dim % out.dim())
            if results is None:
                return None
            new_args, new_kwargs = (results, *args[1:]), dict(kwargs)
        elif target is aten.slice.Tensor:
            ndim = out.dim()
            if (args[1] if len(args) > 1 else 0) % ndim == dim % ndim:
                return None
            new_args, new_kwargs = (self.select(args[0], dim), *args[1:]), dict(kwargs)
        elif target in RESHAPES:
            moved = self._reshape(node, dim % out.dim())
            if moved is None:
                return None
            new_args, new_kwargs = moved, dict(kwargs)
        elif target in (packing.packed_linear, linear_groups.packed_linear_group, aten.mm.default):
            if dim % out.dim() == out.dim() - 1:
                return None  # the rows are the features
            new_args, new_kwargs = (self.select(args[0], dim % out.dim()), *args[1:]), dict(kwargs)
        elif target is aten.addmm.default:
            if dim % out.dim() != 0 or _has_rows(args[0], 0, self.rows):
                return None
            new_args, new_kwargs = (args[0], self.select(args[1], 0), *args[2:]), dict(kwargs)
        else:
            return None
        self.moved.add(node)
        return self._make(target, new_args, new_kwargs, after=node)

    def _results(self, node: Node, row: int) -> Node | None:
        """A multi-result reduction (``var_mean``) on the selected rows, built once for all its ``getitem``s;
        None where it reduces over the rows or something else reads it."""
        key = (node, row)
        if key not in self.done:
            if not _reduces_beside(node, row) or (self.allowed is not None and node not in self.allowed):
                return None
            self.moved.add(node)
            self.done[key] = self._make(node.target, (self.select(node.args[0], row), *node.args[1:]),
                                        dict(node.kwargs), after=node)  # fmt: skip
        return self.done[key]

    def _reshape(self, node: Node, row: int) -> tuple | None:
        """A reshape's args on the selected rows, where each row is the same run of elements before and
        after it: only dims of size 1 before the rows on either side, the same number of elements after."""
        source, out, shape = _val(node.args[0]), _val(node), list(node.args[1])
        found = [d for d in range(source.dim()) if _same(source.shape[d], self.rows)]
        if len(found) != 1 or len(shape) != out.dim():
            return None
        src_row = found[0]
        ones = all(_same(s, 1) for s in (*source.shape[:src_row], *out.shape[:row]))
        after_in, after_out = source.shape[src_row + 1 :], out.shape[row + 1 :]
        if not ones or not all(isinstance(s, int) for s in (*after_in, *after_out)):
            return None
        if torch.Size(after_in).numel() != torch.Size(after_out).numel():
            return None
        if any(isinstance(s, Node) for i, s in enumerate(shape) if i != row):
            return None  # only the rows may be a symbol: the new shape names the selected count there
        shape[row] = self.count_node()
        return self.select(node.args[0], src_row), shape


class _NotRowWise(Exception):
    pass


def _reduces_beside(node: Node, row: int) -> bool:
    """Whether reduction ``node`` (dims in its second argument, ``keepdim`` its third or a kwarg) leaves dim
    ``row`` of its input where it was: reduced over other dims only, none dropped before it."""
    args, kwargs = node.args, node.kwargs
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = bool(args[2] if len(args) > 2 and not isinstance(args[2], Node) else kwargs.get("keepdim", False))
    source = _val(args[0])
    if source is None or not dims:
        return False
    reduced = [d % source.dim() for d in dims]
    return row not in reduced and (keep or min(reduced) > row)


def _sampled_row_selection(node: Node) -> tuple[Node, int] | None:
    """``(rows, dim)`` when ``node`` selects rows of a tensor by one 1-D index (``x[:, rows]``)."""
    if node.op != "call_function" or node.target is not aten.index.Tensor:
        return None
    indices = node.args[1]
    picked = [(i, n) for i, n in enumerate(indices) if n is not None]
    if len(picked) != 1:
        return None
    dim, rows = picked[0]
    value = _val(rows)
    if value is None or value.dim() != 1 or value.dtype not in (torch.int64, torch.int32):
        return None
    return rows, dim


class SampledRows(CustomGraphPass):
    """Inductor post-grad pass: the selection of the sampled rows moved up to the last op that is not
    row-wise (see the module's docstring)."""

    def __call__(self, graph: Graph) -> None:
        move_row_selections(graph)
        linear_groups.GROUP_LINEARS(graph)  # then the projections of the selected rows group too

    def uuid(self) -> bytes:  # inductor's disk cache keys graphs on it
        return get_hash_for_files((__file__,)) + linear_groups.GROUP_LINEARS.uuid()


def move_row_selections(graph: Graph) -> int:
    """Moves each ``x[:, rows]`` of ``graph`` above the row-wise ops that made ``x``; returns how many ops
    now run on the selected rows only."""
    moved, inserted = 0, False
    for node in list(graph.nodes):
        found = _sampled_row_selection(node)
        if found is None:
            continue
        rows_node, dim = found
        source = node.args[0]
        value = _val(source)
        if value is None or not isinstance(value.shape[dim], torch.SymInt):
            continue  # a fixed row count: the graph of one shape, nothing to gain from moving
        mover = _Mover(graph, node, rows_node, value.shape[dim])
        built = False
        try:
            mover._through(source, dim)
            mover.restrict()
            if source not in mover.allowed:
                continue
            built = True
            replacement = mover._through(source, dim)
        except Exception:  # an op whose shapes it could not work out: this selection stays where it is
            logger.debug("hf_paged_attn: a row selection not moved", exc_info=True)
            continue
        finally:
            inserted = inserted or built
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        moved += len(mover.moved)
    if inserted:  # what the selections no longer read, and what a failed build left unread
        graph.eliminate_dead_code()
    return moved


SAMPLED_ROWS = SampledRows()
