"""Only the sampled rows after the last attention (``hf_paged_attn/runtime/cpu/sampled_rows.py``): the pass
moves a row selection above the row-wise ops of a graph (which then run on the selected rows only), stops
at ops that mix rows and at results something else reads whole, leaves the graph's answer unchanged, and
a compiled engine with it keeps greedy parity with sdpa."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import sampled_rows
from hf_paged_attn.runtime.cpu.compiled import CompiledExecutor
from hf_paged_attn_tools.testing import (
    compare_greedy,
    load_pair,
    ragged_prompts,
    reference_greedy,
    save_random_model,
    tiny_llama_config,
)

aten = torch.ops.aten
D, H, F_DIM = 32, 4, 48


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"wo": (D, D), "wg": (F_DIM, D), "wu": (F_DIM, D), "wd": (D, F_DIM), "nw": (D,)}
    return {name: torch.randn(*shape, generator=gen) * 0.2 for name, shape in shapes.items()}


def tail(h0, attn_in, wo, wg, wu, wd, nw, rows):  # noqa: ANN001, ANN201
    """A decoder's last layer after its attention, then a final norm and the sampled rows, as the
    compiled forward sees it. ``cumsum`` along the rows stands for the attention (it mixes rows);
    ``h`` is also read whole by a second output (as the last layer's input is, by its keys)."""
    h = h0 * 3.0
    attn = torch.cumsum(attn_in, dim=1)  # [1, M, H, D/H]
    x = h + F.linear(attn.reshape(1, attn.shape[1], -1), wo)
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    y = x + F.linear(F.silu(F.linear(n, wg)) * F.linear(n, wu), wd)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    return y[:, rows], h.sum(-1)


def inputs(m: int, selected: list[int]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(m)
    h0 = torch.randn(1, m, D, generator=gen)
    attn_in = torch.randn(1, m, H, D // H, generator=gen)
    w = weights()
    return (h0, attn_in, w["wo"], w["wg"], w["wu"], w["wd"], w["nw"], torch.tensor(selected))


class Recorder:
    """A post-grad pass that runs ``move_row_selections`` (as ``SAMPLED_ROWS`` does) and keeps, for each graph
    inductor compiled, how many ops it moved and the graph after it."""

    def __init__(self) -> None:
        self.moved: list[int] = []
        self.graphs: list[torch.fx.Graph] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.moved.append(sampled_rows.move_row_selections(graph))
        self.graphs.append(graph)

    def uuid(self) -> None:
        return None


def compiled(fn, recorder: Recorder):  # noqa: ANN001, ANN201
    """``fn`` compiled by inductor with the row count dynamic, ``recorder`` as its post-grad pass."""
    graph = torch.compile(fn, dynamic=False)

    def run(*args: torch.Tensor):  # noqa: ANN202
        for t in args[:-1]:
            if t.dim() >= 3:  # activations [1, rows, ...] (weights are 1-D or 2-D)
                torch._dynamo.mark_dynamic(t, 1)
        torch._dynamo.mark_dynamic(args[-1], 0)  # the selected rows
        with torch._inductor.config.patch(post_grad_custom_pre_pass=recorder, fx_graph_cache=False):
            return graph(*args)

    return run


def mm_rows(graph: torch.fx.Graph) -> list[object]:
    """The row count of each matmul's input, as the graph knows it (symbols)."""
    return [n.args[1 if n.target is aten.addmm.default else 0].meta["val"].shape[0] for n in graph.nodes
            if n.target in (aten.mm.default, aten.addmm.default)]  # fmt: skip


@pytest.fixture(scope="module")
def three_layer_dir(tmp_path_factory) -> str:
    config = tiny_llama_config(num_hidden_layers=3, initializer_range=0.1)
    return save_random_model(config, tmp_path_factory.mktemp("sampled_rows"))


def test_compiled_engine_runs_the_last_layer_on_the_sampled_rows_and_equals_sdpa(three_layer_dir, monkeypatch) -> None:
    """Prompt steps of 32 rows with a few sampled: the pass (``inductor_options``) moves the last layer's tail
    below the selection and the compiled engine keeps sdpa's greedy tokens. The background compile runs in
    this thread's context (``CompiledModel.start``), so the caches disabled here are disabled there: the pass
    really runs, whatever graphs earlier tests left in inductor's caches."""
    moved: list[int] = []
    real = sampled_rows.move_row_selections

    def record(graph):  # noqa: ANN001, ANN202
        moved.append(real(graph))
        return moved[-1]

    monkeypatch.setattr(sampled_rows, "move_row_selections", record)
    ref, paged = load_pair(three_layer_dir)
    prompts = ragged_prompts(5, 3, 40, seed=4)
    expected = [reference_greedy(ref, p, 12) for p in prompts]
    torch._dynamo.reset()
    # The pass runs only when a graph is compiled, not when a cache (inductor's, AOT autograd's) serves it.
    with torch._inductor.config.patch(force_disable_caches=True):
        with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=True, max_batch_tokens=32)) as engine:
            inner = getattr(engine.executor, "inner", engine.executor)
            assert isinstance(inner, CompiledExecutor)
            assert engine.executor.wait(timeout=600) and engine.executor.failed is None
            got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=12)]
            assert engine.executor.num_compiled_steps > 5
    # the last layer's output projection, norm, MLP and the final norm moved below the selection
    assert moved and max(moved) >= 10
    assert not compare_greedy(ref, prompts, expected, got)


def test_the_selection_moves_above_the_row_wise_ops_and_the_answer_is_the_same() -> None:
    torch._dynamo.reset()
    recorder = Recorder()
    run = compiled(tail, recorder)
    for m, selected in ((9, [2, 8]), (17, [0, 5, 16]), (6, [0, 1, 2, 3, 4, 5])):
        args = inputs(m, selected)
        for got, want in zip(run(*args), tail(*args)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(recorder.graphs) == 1  # one graph for every row count
    graph, moved = recorder.graphs[0], recorder.moved[0]
    assert moved >= 10  # the projections, norms, activation and adds of the tail
    rows = next(n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor)
                and n.meta["val"].dim() == 1
                and n.meta["val"].dtype == torch.int64).meta["val"].shape[0]  # fmt: skip
    counts = mm_rows(graph)
    assert len(counts) == 4 and all(str(c) == str(rows) for c in counts)  # every matmul: the selected rows only
    # the attention stand-in and the layer input, which other ops read whole, are computed once, whole
    assert sum(n.target is aten.cumsum.default for n in graph.nodes) == 1
    assert sum(n.target is aten.mul.Tensor and n.args[1] == 3.0 for n in graph.nodes) == 1


def layer_norm_tail(h, wo, wd, nw, nb, rows):  # noqa: ANN001, ANN201
    """A GPT-2-like tail: LayerNorm (``var_mean`` under inductor) and an MLP with biases (``addmm``)."""
    x = h + F.linear(F.layer_norm(h, (D,), nw, nb), wo, nb)
    y = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (D,), nw, nb), wd.t(), None)), wd, nb)
    return F.layer_norm(y, (D,), nw, nb)[:, rows]


def test_a_layer_norm_tail_moves_too() -> None:
    torch._dynamo.reset()
    recorder = Recorder()
    run = compiled(layer_norm_tail, recorder)
    w = weights()
    for m, selected in ((9, [2, 8]), (13, [0, 12, 5])):
        h = torch.randn(1, m, D, generator=torch.Generator().manual_seed(m))
        args = (h, w["wo"], w["wd"], w["nw"], w["nw"] * 0.5, torch.tensor(selected))
        torch.testing.assert_close(run(*args), layer_norm_tail(*args), rtol=1e-5, atol=1e-5)
    graph = recorder.graphs[0]
    assert recorder.moved[0] >= 10
    rows = next(n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor)
                and n.meta["val"].dtype == torch.int64).meta["val"].shape[0]  # fmt: skip
    # nothing else reads the input here: every projection and every norm's statistics, on the selected rows
    counts = [str(c) for c in mm_rows(graph)]
    assert counts == [str(rows)] * 3
    stats = [n for n in graph.nodes if n.target is aten.var_mean.correction]
    assert [str(n.args[0].meta["val"].shape[1]) for n in stats] == [str(rows)] * 3


def test_ops_that_read_other_rows_are_computed_whole() -> None:
    def scan(x, rows):  # noqa: ANN001, ANN202
        return torch.cumsum(x, dim=1)[:, rows] * 2.0  # every row of the scan reads the rows before it

    def normalised(x, rows):  # noqa: ANN001, ANN202
        # the softmax's max and sum read every row; its last division is row-wise and moves
        return torch.softmax(x, dim=1)[:, rows]

    for fn, moved in ((scan, 0), (normalised, 1)):
        torch._dynamo.reset()
        recorder = Recorder()
        run = compiled(fn, recorder)
        for m, selected in ((7, [1, 4]), (11, [0, 10])):
            x, rows = torch.randn(1, m, 5), torch.tensor(selected)
            torch.testing.assert_close(run(x, rows), fn(x, rows))
        assert recorder.moved == [moved]


def test_a_build_that_fails_halfway_leaves_the_selection_where_it_was(monkeypatch) -> None:
    real = sampled_rows._Mover._make
    made: list[object] = []

    def make(self, target, args, kwargs, after):  # noqa: ANN001, ANN202
        if not self.planning and len(made) >= 3:  # some nodes already inserted, then an op it can't build
            raise RuntimeError("no fake value for this op")
        node = real(self, target, args, kwargs, after)
        made.append(node) if not self.planning else None
        return node

    monkeypatch.setattr(sampled_rows._Mover, "_make", make)
    torch._dynamo.reset()
    recorder = Recorder()
    run = compiled(tail, recorder)
    args = inputs(9, [2, 8])
    for got, want in zip(run(*args), tail(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert recorder.moved == [0] and len(made) == 3
    graph = recorder.graphs[0]
    assert not any(node in graph.nodes for node in made)  # the half-built nodes went with the dead code
    assert len(mm_rows(graph)) == 4


def test_the_pass_moves_the_rows_then_groups_the_projections(monkeypatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(sampled_rows, "move_row_selections", lambda graph: seen.append("rows") or 0)
    monkeypatch.setattr(sampled_rows.linear_groups.GroupLinears, "__call__", lambda self, graph: seen.append("groups"))
    sampled_rows.SAMPLED_ROWS(torch.fx.Graph())
    assert seen == ["rows", "groups"]
    # inductor's disk cache keys graphs on both passes' sources
    assert sampled_rows.SAMPLED_ROWS.uuid().endswith(sampled_rows.linear_groups.GROUP_LINEARS.uuid())
