"""CUDA graphs of decode steps (``hf_paged_attn/runtime/cuda_graphs.py``), tested on the CPU.

No GPU here, so the capture is swapped for ``FrozenGraphs`` (``hf_paged_attn_tools/testing.py``):
"capture" traces the function once, "replay" runs the recorded ops only, with every host-side value of
the capture (Python numbers, shapes, kernel arguments) frozen, as a CUDA graph freezes them, and a host
read during capture fails, as a device sync does. The decode kernel of the graphs' backend is one
recorded launch (``LaunchedDecode``): the native C kernel (``NativeDecode``), or the Triton backend's
under the interpreter.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from types import SimpleNamespace

# Must precede the first `import triton` (see tests/test_kernels_triton.py).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

import hf_paged_attn  # noqa: E402, F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn.attention.step import build_step  # noqa: E402
from hf_paged_attn.kernels import BACKENDS, cpu_native  # noqa: E402
from hf_paged_attn.kernels.base import AttentionOptions  # noqa: E402
from hf_paged_attn.kernels.torch_backend import TorchBackend  # noqa: E402
from hf_paged_attn.kernels.triton_backend import TritonBackend  # noqa: E402
from hf_paged_attn.runtime import config as config_module  # noqa: E402
from hf_paged_attn.runtime.cuda_graphs import CudaGraphExecutor, decode_buckets, max_blocks_per_seq  # noqa: E402
from hf_paged_attn.runtime.executor import LocalExecutor
from hf_paged_attn.runtime.launcher import LocalLauncher  # noqa: E402
from hf_paged_attn_tools.testing import (  # noqa: E402
    FrozenGraphs,
    LaunchedDecode,
    compare_greedy,
    left_padded,
    load_pair,
    save_random_model,
    tiny_llama_config,
)
from hf_paged_attn_tools.tiny_configs import tiny_config  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class NativeDecode(TorchBackend):
    """The torch backend whose decode is always its native C kernel (``kernels/cpu_attention.c``): one
    call that reads lengths and block tables from the tensors it is given, as flash-attn's kernel does on
    a GPU, so graph-safe. The torch backend itself is not: where the native kernel declines (and on a
    GPU) it plans on the host (``test_a_backend_that_plans_on_the_host_is_never_replayed``)."""

    graph_safe = True

    @staticmethod
    def paged_decode_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor,
        max_seqlen_k: int | None = None,
        *,
        options: AttentionOptions,
        memo: dict | None = None,
    ) -> torch.Tensor:
        assert options.causal and max_seqlen_k is not None
        out = cpu_native.paged_decode(q, k_cache, v_cache, k, v, cache_seqlens, block_table, options.softmax_scale,
                                      options.window_size[0], options.softcap, options.sinks, max_seqlen_k)  # fmt: skip
        assert out is not None, "the native decode kernel declined the call"
        return out


class RecordingBackend:
    """A backend's stand-in that records which block-table storage each decode call read."""

    def __init__(self, backend) -> None:
        self.backend, self.tables = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def paged_decode_attention(self, *args, **kwargs):
        self.tables.append(args[6].data_ptr())  # block_table
        return self.backend.paged_decode_attention(*args, **kwargs)


@pytest.fixture
def graphs_on(monkeypatch):
    """Engines built while this is active run a ``CudaGraphExecutor`` with ``FrozenGraphs`` on the
    CPU; returns the executors. ``settings.backend`` makes the graphs' backend from the engine's (default:
    ``NativeDecode``); ``settings.launch`` (default True) makes its decode one launch (``LaunchedDecode``)."""
    runners: list[CudaGraphExecutor] = []
    settings = SimpleNamespace(backend=lambda _: NativeDecode(), launch=True)

    def executor(self, model, cache, backend, config, layers, size):
        backend = settings.backend(backend)
        backend = LaunchedDecode(backend) if settings.launch else backend
        max_positions = model.config.max_position_embeddings
        runners.append(CudaGraphExecutor(LocalExecutor(model, cache, backend), layers, config, size.num_blocks,
                                         max_positions, graph_factory=FrozenGraphs()))  # fmt: skip
        return runners[-1]

    close = CudaGraphExecutor.close

    def keep_what_was_captured(self) -> None:  # model.generate closes its engine: its graphs go, the record stays
        self.captured_at_close = dict(self.captured)
        close(self)

    # the scratch page of graphs' padding rows, which the config (no graphs on the CPU) does not ask for
    cache_size = LocalLauncher.cache_size

    def with_scratch_page(self, model, config, *args):
        return cache_size(self, model, config.replace(cuda_graphs=True), *args)

    monkeypatch.setattr(LocalLauncher, "cache_size", with_scratch_page)
    monkeypatch.setattr(LocalLauncher, "executor", executor)
    monkeypatch.setattr(CudaGraphExecutor, "close", keep_what_was_captured)
    return SimpleNamespace(runners=runners, settings=settings)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_pair(save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("llama")))


def triton_backend():
    from hf_paged_attn.kernels import triton_ops as tb

    if not isinstance(tb._decode_kernel, triton.runtime.interpreter.InterpretedFunction):
        tb = importlib.reload(tb)  # imported before TRITON_INTERPRET was set: rebuild it interpreted
    return tb


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]


def greedy_one_by_one(ref, prompts: list[list[int]], new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=new, do_sample=False)  # fmt: skip
        outs.append(out[0, len(p) :].tolist())
    return outs


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------


def test_buckets_and_table_width():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(1) == [1]
    assert decode_buckets(4) == [1, 2, 4]
    assert max_blocks_per_seq(512, 16, 10_000) == 32
    assert max_blocks_per_seq(513, 16, 10_000) == 33
    assert max_blocks_per_seq(512, 16, 20) == 20  # never wider than the cache
    assert max_blocks_per_seq(None, 16, 20) == 20


def test_graphs_are_on_by_default_only_on_cuda_with_a_graph_safe_kernel(monkeypatch):
    from hf_paged_attn.kernels import flash_backend

    monkeypatch.setattr(flash_backend, "installed_version", lambda: "2.8.3")  # flash's rule: test_flash_backend.py
    assert [name for name, b in BACKENDS.items() if b.graph_safe] == ["flash", "triton"]
    assert PagedConfig().resolved(CPU).cuda_graphs is False
    assert PagedConfig(kernel="triton").resolved(CUDA).cuda_graphs is True
    assert PagedConfig(kernel="torch").resolved(CUDA).cuda_graphs is False  # plans its decode on the host
    assert PagedConfig(kernel="triton", cuda_graphs=False).resolved(CUDA).cuda_graphs is False
    for config, device in ((PagedConfig(cuda_graphs=True), CPU), (PagedConfig(kernel="torch", cuda_graphs=True), CUDA)):
        with pytest.raises(ValueError, match=r"cuda_graphs=True"):
            config.resolved(device)
    with pytest.raises(ValueError, match=r"cuda_graphs must be None or a bool, got 'yes'"):
        PagedConfig(cuda_graphs="yes")


def test_an_engine_on_the_cpu_runs_eagerly(llama):
    _, paged = llama
    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=32))
    executor = getattr(engine.executor, "inner", engine.executor)  # under adaptive threads with >1 thread
    assert engine.config.cuda_graphs is False and type(executor) is LocalExecutor
    assert engine.cache.num_blocks == engine.allocator.num_blocks == 32  # no scratch page
    with pytest.raises(ValueError, match=r"cuda_graphs=True"):
        ContinuousBatchingEngine(paged, PagedConfig(num_blocks=32, cuda_graphs=True))


def test_which_models_get_graphs(llama, monkeypatch):
    """``PagedConfig.placed`` and ``LocalLauncher`` on a model that claims to sit on CUDA (nothing CUDA runs
    until a capture)."""
    _, paged = llama
    config = PagedConfig(kernel="triton", block_size=16, cuda_graphs=True)
    launcher = LocalLauncher()
    monkeypatch.setattr(config_module, "layer_devices", lambda model: [CUDA, CUDA])
    assert config.placed(paged).cuda_graphs and not config.replace(cuda_graphs=False).placed(paged).cuda_graphs
    size = launcher.cache_size(paged, config, engine_layers(paged), 100)
    assert (size.num_blocks, size.num_pages) == (100, 101)  # the scratch page
    runner = launcher.executor(paged, None, None, config, engine_layers(paged), size)
    assert isinstance(runner, CudaGraphExecutor) and runner.width == 32 and runner.scratch_block == 100
    assert runner.buckets[-1] == 64 and runner.num_captures == 0
    with monkeypatch.context() as m:
        m.setattr(paged, "hf_device_map", {"model": 0, "lm_head": "cpu"}, raising=False)  # offloaded
        assert not config.placed(paged).cuda_graphs
        m.setattr(paged, "hf_device_map", {"": 0}, raising=False)
        assert config.placed(paged).cuda_graphs
    monkeypatch.setattr(config_module, "layer_devices", lambda model: [CUDA, torch.device("cuda:1")])
    assert not config.placed(paged).cuda_graphs  # layers on two devices
    monkeypatch.setattr(config_module, "layer_devices", lambda model: [CPU])
    assert not config.placed(paged).cuda_graphs


def engine_layers(model):
    from hf_paged_attn.core.layers import LayerKinds

    return LayerKinds.from_config(model.config)


# ----------------------------------------------------------------------------------------------
# the stand-in: what a graph freezes stays frozen
# ----------------------------------------------------------------------------------------------


def test_the_stand_in_replays_ops_not_python():
    """Tensors are read at every replay and in-place writes happen again; a Python number is the
    capture's; reading a tensor on the host fails the capture; a backend that plans on the host cannot
    be one launch."""
    static, pages, host = torch.zeros(3), torch.zeros(3), {"n": 1}

    def step() -> torch.Tensor:
        pages.add_(static)
        return static * 2 + host["n"]

    graph, out = FrozenGraphs()(step)
    static.fill_(5.0)
    host["n"] = 100
    graph.replay()
    assert out.tolist() == [11.0] * 3 and pages.tolist() == [5.0] * 3
    with pytest.raises(RuntimeError, match=r"Tensor.item: a host read"):
        FrozenGraphs()(lambda: static * static.sum().item())
    with pytest.raises(AssertionError, match=r"graph-safe"):
        LaunchedDecode(TorchBackend())


def test_a_host_value_passed_to_the_kernel_is_the_captures(llama, graphs_on, monkeypatch):
    """The bug class graphs cause: a value the runner hands the forward from the host (here each step's
    own key bound, tighter than the table's) reaches the kernel as it was at capture. Steps after the
    capture attend more keys than that bound, which the launch checks (``launch_decode``)."""
    _, paged = llama
    execute, logits = CudaGraphExecutor.execute, LocalExecutor.logits

    def remember(self, step):
        self.eager.longest = step.max_length_k
        return execute(self, step)

    def bounded(self, step, keep):
        groups = tuple(dataclasses.replace(g, max_length_k=self.longest) for g in step.groups)
        return logits(self, dataclasses.replace(step, groups=groups), keep)

    monkeypatch.setattr(CudaGraphExecutor, "execute", remember)
    monkeypatch.setattr(LocalExecutor, "logits", bounded)
    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=40))
    outputs = engine.generate(prompts_of([6, 13], seed=4), max_new_tokens=4)
    assert engine.executor.num_replays > 0
    assert {o.finish_reason for o in outputs} == {"error"}, "a frozen bound went unnoticed"
    assert all("max_seqlen_k=14, but a request attends 15 keys" in o.error for o in outputs)


# ----------------------------------------------------------------------------------------------
# greedy parity through the runner
# ----------------------------------------------------------------------------------------------


def test_model_generate_with_graphs_equals_sdpa(llama, graphs_on):
    """Staggered admission (small token budget, max_num_seqs=5 for 9 prompts): the decode batch
    grows and shrinks across buckets 1, 2, 4 and 5 (max_num_seqs) while requests finish and others
    start."""
    ref, paged = llama
    graphs_on.settings.backend = lambda _: RecordingBackend(NativeDecode())
    prompts = prompts_of([3, 17, 9, 30, 5, 12, 22, 7, 14])
    new = 12
    ids, mask = left_padded(prompts)
    config = PagedConfig(max_num_seqs=5, max_batch_tokens=16)
    out = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, paged_config=config)
    got = [row[ids.shape[1] :].tolist() for row in out]
    problems = compare_greedy(ref, prompts, greedy_one_by_one(ref, prompts, new), got)
    assert not problems, problems

    (runner,) = graphs_on.runners
    factory = runner.graph_factory
    assert not runner.captured  # the engine of model.generate was shut down: its graphs freed
    captured = runner.captured_at_close
    replays = {bucket: c.graph.replays for bucket, c in captured.items()}
    assert set(replays) == {1, 2, 4, 5}, f"buckets used: {replays}"
    assert runner.num_captures == len(factory.captured) == len(captured)  # each bucket once
    assert all(n > 0 for n in replays.values()) and sum(replays.values()) == runner.num_replays
    assert runner.num_replays > runner.num_captures  # captured graphs are reused
    # every decode call the graphs made read the static block table, never a step's own
    static_table = runner.buffers.tables[0].block_table.data_ptr()
    tables = runner.eager.backend.tables
    assert set(tables) == {static_table}
    assert len(tables) == paged.config.num_hidden_layers * (runner.num_replays + runner.num_captures)


def test_triton_decode_through_graphs_equals_sdpa(llama, graphs_on):
    """The Triton decode kernel (interpreted) reading the static buffers; prefill runs eagerly on
    the torch backend. Requests of different lengths finish one after another."""
    tb = triton_backend()
    ref, paged = llama
    assert tb is not None
    graphs_on.settings.backend = lambda _: TritonBackend()
    prompts = prompts_of([4, 20, 11], seed=1)
    new = [6, 2, 4]
    engine = ContinuousBatchingEngine(paged, PagedConfig(kernel="torch", block_size=16, num_blocks=24))
    outputs = engine.generate(prompts, max_new_tokens=new)
    expected = [greedy_one_by_one(ref, [p], n)[0] for p, n in zip(prompts, new)]
    problems = compare_greedy(ref, prompts, expected, [o.output_ids for o in outputs])
    assert not problems, problems
    runner = engine.executor
    assert set(runner.captured) == {1, 2, 4} and runner.num_replays >= 5


def test_hybrid_model_graphs_fill_every_groups_tables(tmp_path, graphs_on):
    """A Qwen2 with one full and three sliding layers (window 8): four attention groups of one
    layer, each with its own static block table."""
    config = tiny_config("qwen2")
    config.use_sliding_window, config.max_window_layers, config.sliding_window = True, 1, 8
    config.layer_types = ["full_attention"] + ["sliding_attention"] * (config.num_hidden_layers - 1)
    ref, paged = load_pair(save_random_model(config, tmp_path))
    prompts = prompts_of([5, 19, 12], seed=2)
    new = [14, 9, 11]
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=200))
    outputs = engine.generate(prompts, max_new_tokens=new)
    expected = [greedy_one_by_one(ref, [p], n)[0] for p, n in zip(prompts, new)]
    problems = compare_greedy(ref, prompts, expected, [o.output_ids for o in outputs])
    assert not problems, problems
    runner = engine.executor
    assert len(runner.buffers.tables) == len(engine.layers.groups) > 1
    assert runner.num_replays > 0


# ----------------------------------------------------------------------------------------------
# one step by hand: padding rows, fallbacks
# ----------------------------------------------------------------------------------------------


def decode_step_of(engine, prompts: list[list[int]]):
    """Prefill ``prompts`` in one step, then schedule (but do not run) the decode step after it."""
    for p in prompts:
        engine.add_request(p, max_new_tokens=8)
    engine.step()
    plan = engine.scheduler.schedule()
    meta = build_step(plan.scheduled, engine.config.block_size, engine.device, engine.layers)
    assert meta.is_decode
    return plan, meta


def pages_of(engine) -> list[torch.Tensor]:
    return [t.clone() for layer in engine.cache.layers for t in (layer.keys, layer.values)]


def test_padding_rows_write_only_the_scratch_block(llama, graphs_on):
    _, paged = llama
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=8, num_blocks=40))
    runner = engine.executor
    assert engine.cache.num_blocks == engine.allocator.num_blocks + 1 == runner.scratch_block + 1
    plan, meta = decode_step_of(engine, prompts_of([5, 11, 16]))  # 3 rows: bucket 4, one padding row
    with torch.inference_mode():  # garbage in the scratch block must not reach the real rows
        for layer in engine.cache.layers:
            layer.keys[runner.scratch_block] = 7.0
            layer.values[runner.scratch_block] = -7.0
    before = pages_of(engine)
    with torch.inference_mode():  # as the engine's step
        logits = runner.execute(meta)
    after = pages_of(engine)
    assert runner.num_replays == 1 and set(runner.captured) == {4}

    bs = engine.config.block_size
    live = set(meta.slot_mapping.tolist())  # the new tokens' slots
    scratch = set(range(runner.scratch_block * bs, (runner.scratch_block + 1) * bs))
    changed = set()
    for old, new in zip(before, after):
        flat = (old != new).reshape(old.shape[0] * bs, -1).any(dim=1)  # [num_blocks * block_size]
        changed |= set(flat.nonzero().flatten().tolist())
    assert changed - scratch == live, "a padding row wrote outside the scratch block"
    # the padding row's token (K/V of the zero pad embedding) went to the scratch block's first slot
    assert changed & scratch == {runner.scratch_block * bs}, "the padding row wrote nothing: did the bucket have one?"

    with torch.inference_mode():
        eager = runner.eager.execute(meta)  # the same step again, eagerly: same K/V, same logits
    assert logits.shape == eager.shape == (3, paged.config.vocab_size)
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)


def test_steps_the_graphs_leave_to_the_eager_path(llama, graphs_on):
    _, paged = llama
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=8, num_blocks=40, max_num_seqs=2))
    runner = engine.executor
    assert runner.buckets == [1, 2] and runner.width == 40  # 512 positions hold 64 blocks; the cache has 40
    _, meta = decode_step_of(engine, prompts_of([5, 11]))
    assert runner.bucket_for(meta) == 2
    assert runner.bucket_for(dataclasses.replace(meta, has_beams=True)) is None  # beam search
    engine.layers.observed = False
    assert runner.bucket_for(meta) is None  # the first step shows the layers' windows
    engine.layers.observed = True
    runner.width = 1  # the requests' tables (2 blocks) are wider than the buffers
    assert runner.bucket_for(meta) is None
    runner.width = 40
    runner.buckets = [1]  # more rows than the largest bucket
    assert runner.bucket_for(meta) is None
    runner.buckets = [1, 2]
    assert runner.bucket_for(dataclasses.replace(meta, is_decode=False)) is None
    assert runner.num_captures == 0


def test_a_failed_capture_leaves_the_engine_eager(llama, graphs_on, caplog):
    ref, paged = llama

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=40))
    engine.executor.graph_factory = broken
    prompts = prompts_of([6, 13], seed=3)
    outputs = engine.generate(prompts, max_new_tokens=5)
    assert [o.output_ids for o in outputs] == greedy_one_by_one(ref, prompts, 5)
    assert "not permitted" in engine.executor.failed and engine.executor.num_replays == 0
    assert "decode steps run eagerly" in caplog.text


def test_a_backend_that_plans_on_the_host_is_never_replayed(llama, graphs_on, monkeypatch, caplog):
    """Why ``PagedConfig`` refuses graphs with the torch backend: its decode as it runs on a GPU (torch
    ops; the native kernel is the CPU's) reads lengths back to the host to plan its gathers. Forced
    through the runner, its capture fails on that read, and every step runs eagerly, still right."""
    ref, paged = llama
    monkeypatch.setattr(cpu_native, "paged_decode", lambda *args, **kwargs: None)  # declines: the torch ops run
    graphs_on.settings.backend, graphs_on.settings.launch = (lambda backend: backend), False
    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=40))
    assert type(engine.executor.eager.backend) is TorchBackend
    prompts = prompts_of([6, 13], seed=3)
    outputs = engine.generate(prompts, max_new_tokens=5)
    assert [o.output_ids for o in outputs] == greedy_one_by_one(ref, prompts, 5)
    assert "a host read of a device tensor" in engine.executor.failed and engine.executor.num_replays == 0
    assert "decode steps run eagerly" in caplog.text
