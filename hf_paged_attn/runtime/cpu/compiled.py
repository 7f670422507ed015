"""A compiled forward for the CPU: the model's forward through ``torch.compile`` (inductor), as vLLM
compiles its models, with the paged attention left to the compiler as one opaque op.

``CompiledExecutor`` wraps a ``LocalExecutor``. One graph serves every step: its token count is
dynamic (``run_graph``), as vLLM's is (bucketing, one static graph per padded size, compiled 5
graphs in 94 s where the dynamic one took 40 s, and static shapes make inductor pick MKL's slow fp32
matmuls here: docs/performance.md), and so is its thread count (``STEP_THREADS``). The compile runs
in a background thread on a step of padding rows (``CompiledModel.start``, logged), so no request
waits for it: steps run eagerly until the graph is ready. A model this machine never compiled is compiled
first by a child process on idle CPU time (``prewarm.py``), whose graphs the thread then loads in seconds.
It starts once the model has run
``COMPILE_AFTER_STEPS`` steps (a short script never compiles), and a process that exits while it
runs waits for it to end (an interpreter torn down under it aborted the process). It is kept per
model (``compiled_model``): a second engine (a second ``model.generate``) on the same model compiles
nothing.

What the graph sees:

- ``input_ids`` / ``position_ids`` [1, N] and ``logits_indices`` [S], both sizes dynamic; for the steps of a
  vision-language model that feed image features, ``inputs_embeds`` [1, N, hidden] in place of the ids, and
  for an M-RoPE model's (Qwen-VL) steps with images, positions [3, 1, N]: each such kind of step is a graph
  of its own (``StepKind``), all compiled together (``step_kinds``);
- a ``StepCache`` in place of the paged cache, whose ``update`` hands K/V through, and the constant
  ``COMPILED`` as the ``paged_forward`` kwarg: nothing in the graph depends on the step, so the
  graph never guards on (and recompiles for) a step's Python numbers or its ``ForwardContext``;
- each layer's attention as ``hf_paged_attn::step_attention`` (``attention.py``), which
  reaches the step through ``COMPILED_STEP`` and runs the eager kernels on the real rows.

Padding rows (a one-token step pads to two rows, since dynamo specialises a size of 1; the
warm-up's rows) are harmless: the attention op never lets them touch the cache and returns zeros
for them; every other op of a decoder is row-wise (projections, norms, rotary, MLP), so they
cannot change a real row; their logits are never taken.

Eager steps and the background compile exclude each other only where they must: torch.fx's tracer
(AOT autograd traces the graph with it) patches ``torch.nn.Module.__call__`` and ``__getattr__``
for the whole process while it traces, so an eager forward in another thread would run through the
tracer (``NameError: module is not installed as a submodule``: a soak failed a step's requests that
way) or into the trace. ``locked_trace`` makes every trace take ``FX_TRACE_LOCK``, which every
eager step of a ``CompiledExecutor`` holds: a step waits while a trace runs (seconds, once), and
the rest of the compile (lowering, C++ builds) runs beside the steps.

What runs eagerly instead: every step until the graph is ready, the first step of an engine (it
confirms each layer's window and runs the model checks, ``check_attention_call``, that the graph
skips), beam search, and everything once the compile has failed (logged, as a failed CUDA graph
capture is). Where the weights are frozen (``inductor_options``: only on request) they are copies
the graph holds; either way, when any of the model's weights
changes after the compile (an optimizer step between generations, a loaded state dict; checked at
every step through version counters, ``CompiledModel.stale``), the model runs eagerly from then on.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import Cache

from ... import torch_private
from ...attention.cache import PagedLayer
from ...attention.forward import ForwardContext
from ...attention.function import COMPILED, LAYER_INDEX
from ...attention.step import StepMetadata
from ...core.layers import LayerKinds
from ..model import lora, lora_rows
from ..model.marks import ModelMarks, marks_for, tensor_index
from ..model.weights import fingerprint
from ..multimodal import CHECKED_FAMILIES, MultimodalInputs, MultimodalSteps
from . import compile_record, linear_groups, packed_linear, prewarm, sampled_rows
from .attention import COMPILED_STEP, CompiledStep
from .patches import install_compile_patches

if TYPE_CHECKING:
    from ..executor import LocalExecutor

logger = logging.getLogger(__name__)

# Inductor options of the compiled forward, patched around every call (``torch.compile(options=)``
# does not apply ``freezing``). The weights stay graph inputs: ``packed_linear`` multiplies by copies
# prepacked for oneDNN (as ``freezing``, which folds the weights into the graph as constants, would have
# inductor do), and the graph, free of unpicklable packed constants, is one that inductor's disk cache
# (``/tmp/torchinductor_$USER``) serves to every later process, which then compiles in seconds instead of
# 25-50 s. The post-grad pass ``sampled_rows.SAMPLED_ROWS`` computes only the sampled rows after the last
# attention, then (``linear_groups.GROUP_LINEARS``) makes the projections that share an input (q/k/v, gate/up)
# one matmul. A half-precision model's graph calls its kernels from C++ (``cpp_wrapper``), not from generated
# Python: passes after the compile, fresh processes alternating, 3 rounds, medians (``hf-paged-attn bench vllm
# --systems ours,ours+cppw --variant cppw:TORCHINDUCTOR_CPP_WRAPPER=1 --no-start-passes``): the bundled model in
# bf16 8,128 against 6,830 tok/s (1.19x), the 30M Llama in bf16 1,385 against 1,298 (1.07x, 6% less CPU time),
# float32 level (5,933 against 6,098 and 738 against 721), so float32 keeps the Python wrapper.
HALF_PRECISION = (torch.bfloat16, torch.float16)


def inductor_options(dtype: torch.dtype = torch.float32) -> dict[str, object]:
    """The compiled forward's inductor options for a model of ``dtype``: no ``freezing``, the sampled rows only
    after the last attention and the packed projections grouped, the kernels called from C++ in half precision
    (see above), and kernels that take the thread count at run time (``cpp.dynamic_threads``: one graph serves
    every count, see ``STEP_THREADS``), and no size asserts: the Python wrapper of a float32 graph checked the
    sizes and strides of every input and custom op's output at every call (67 calls a step of the demo model,
    ~0.7 us each), what dynamo's guards and the ops' fake implementations already pin down; vLLM's CPU platform
    turns them off too."""
    return {"freezing": False, "post_grad_custom_pre_pass": sampled_rows.SAMPLED_ROWS, "cpp.dynamic_threads": True,
            "cpp_wrapper": dtype in HALF_PRECISION, "size_asserts": False}  # fmt: skip


INDUCTOR_OPTIONS: dict[str, object] = inductor_options()
WARMUP_ROWS = 16  # the compile's example step (oneDNN packs the weights for about this many rows)
RECOMPILE_LIMIT = 64  # dynamo's graphs per code object (at least): every model compiles the same function


# The thread count the running compiled step wants, where it differs from the count its graph was compiled
# at. Dynamo guards on torch's thread count (its global-state guard), so a graph compiled at two threads
# would be traced and compiled again for a one-thread step (``threads.ThreadTunedExecutor`` alternates
# them): 5-25 s more of start-up on the 2-core machines of docs/performance.md. Instead ``run_graph``
# enters the graph at the compiled count and ``_backend``'s wrapper, past dynamo's guards, sets the
# step's count for the graph's body: its matmuls and the attention op read torch's count at every call,
# and its inductor kernels read OpenMP's (``cpp.dynamic_threads``).
STEP_THREADS: contextvars.ContextVar[int | None] = contextvars.ContextVar("hf_paged_attn_step_threads", default=None)


def _backend(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
    """Inductor (``compile_fx``, as ``backend="inductor"`` runs it), its compiled function run with the
    step's thread count (``STEP_THREADS``) and the compiled count restored after it."""
    inner = torch_private.compile_fx(gm, example_inputs)

    def run(*args: object) -> object:
        want = STEP_THREADS.get()
        if want is None:
            return inner(*args)
        graph_threads = torch.get_num_threads()
        torch.set_num_threads(want)
        try:
            return inner(*args)
        finally:
            torch.set_num_threads(graph_threads)

    if getattr(inner, "_boxed_call", False):  # inner takes its arguments as one list: so does run
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


FX_TRACE_LOCK = threading.RLock()  # held by a torch.fx trace, and by every eager step of a CompiledExecutor
# The compile starts once the model's engines have run this many steps: a short script (one
# generate of a few dozen tokens) never pays for a compile it would not live to use, nor waits for it
# at exit; a server or a batch job starts it within a second or so. ``CompiledExecutor.wait()`` and
# ``wait_compiled`` start it at once.
COMPILE_AFTER_STEPS = 64
EXIT_WAIT_S = 120.0  # how long the process waits at exit for a compile still running
_COMPILING: set[threading.Thread] = set()  # compile threads still running


def wait_for_compiles_at_exit() -> None:
    """Let a background compile end before the interpreter shuts down: torch's C++ state torn down
    under a compiling thread aborts the process ("terminate called without an active exception",
    exit status 134: a short script that ended while its model compiled did that). A compile that
    has not begun its torch.fx trace stops there (``locked_trace``); one past it cannot be
    interrupted and runs to its end (seconds to a minute), unless inductor fails first because the
    interpreter refuses new worker futures. Past ``EXIT_WAIT_S`` the process exits regardless."""
    global _EXITING
    _EXITING = True
    stopped = prewarm.stop_all()  # a compile in a child process is not waited for: its thread ends at once
    running = [thread for thread in list(_COMPILING) if thread.is_alive()]
    if stopped:
        for thread in running:
            thread.join(0.5)
        running = [thread for thread in running if thread.is_alive()]
    if running:
        logger.warning("hf_paged_attn: waiting (up to %.0f s) for the model's background compile to end before "
                       "exiting; PagedConfig(compile=False) (serve --no-compile) skips it", EXIT_WAIT_S)
    for thread in running:
        thread.join(EXIT_WAIT_S)


_EXITING = False  # the interpreter is exiting: a compile that fails now was abandoned, not broken


def locked_trace(trace: Callable[..., torch.fx.Graph]) -> Callable[..., torch.fx.Graph]:
    """``torch.fx.Tracer.trace`` holding ``FX_TRACE_LOCK``: its patches of ``torch.nn.Module`` are
    process-wide (see the module's docstring). ``integration/register.py`` puts it in place of the
    tracer's own, with the undo (``RECOMPILE_LIMIT`` and ``wait_for_compiles_at_exit`` are its too)."""

    @functools.wraps(trace)
    def traced(self: torch.fx.Tracer, *args: object, **kwargs: object) -> torch.fx.Graph:
        if _EXITING and threading.current_thread() in _COMPILING:  # the process is exiting: stop the compile here
            raise RuntimeError("the interpreter is exiting")
        with FX_TRACE_LOCK:
            return trace(self, *args, **kwargs)

    traced.holds_fx_trace_lock = True  # type: ignore[attr-defined]
    return traced


@dataclass(frozen=True, slots=True)
class StepKind:
    """A kind of step the compiled forward takes, each a graph of its own (dynamo guards on a tensor's rank):
    ``embeds``: image features in ``inputs_embeds`` [1, N, hidden] instead of ids [1, N];
    ``position_dims``: 2 ([1, N]) or 3 (M-RoPE's [3, 1, N])."""

    embeds: bool = False
    position_dims: int = 2


def step_kinds(model: torch.nn.Module) -> tuple[StepKind, ...]:
    """The kinds of step ``model``'s engines run (``multimodal.MultimodalSteps``): a text model's ids and 1-D
    positions; a vision-language model's steps that feed image features as well; an M-RoPE model's steps with
    images run with 3-D positions, those that feed no image feature included."""
    if not MultimodalInputs.takes_images(model) or model.config.model_type not in CHECKED_FAMILIES:
        return (StepKind(),)  # (a family whose images are refused runs text only)
    if not MultimodalSteps.is_mrope_model(model):
        return StepKind(), StepKind(embeds=True)
    return StepKind(), StepKind(position_dims=3), StepKind(embeds=True, position_dims=3)


class StepCache(Cache):
    """The cache the compiled graph sees: ``update`` returns K/V as they are (the attention op
    writes them into the real pages), lengths are per request (0, as ``PagedAttentionCache``)."""

    def __init__(self, windows: list[int | None]) -> None:
        super().__init__(layers=[PagedLayer(0, 1, is_sliding=w is not None) for w in windows])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return 0, 0


@dataclass(slots=True)
class CompiledModel:
    """One model's compiled forward, shared by every engine on the model (``compiled_model``).

    The compile runs in a background thread (``start``) on an example step of padding rows only,
    which never touches a cache; ``ready`` is set when it is done (or has failed: ``failed`` says why).
    """

    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    modules: dict[int, torch.nn.Module]  # layer_idx -> attention module
    tensors: list[torch.Tensor]  # the model's parameters and buffers, whose values the graph froze
    weights: tuple[int, int] = (0, 0)  # their fingerprint when the compile started (``fingerprint``)
    ready: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    failed: str | None = None  # why the compile failed: then this model runs eagerly
    compile_seconds: float = 0.0
    num_compiles: int = 0
    threads: int = 0  # torch's thread count the graph was compiled at (every step enters it at that count)
    regions: list[torch.nn.Module] = field(default_factory=list)  # decoder layers traced as regions
    num_eager_steps: int = 0  # steps run eagerly before the graph was ready, by every engine on the model
    lock: threading.Lock = field(default_factory=threading.Lock)
    pack: bool = False  # the graph runs the bf16 linears on oneDNN-packed weights (``packed_linear``)
    # Packed float32 copies are made (at the compile's start): the eager steps until the graph is ready multiply
    # by them too (``CompiledExecutor.execute``, ``packed_linear.EAGER_DTYPES``).
    packed: threading.Event = field(default_factory=threading.Event)
    model: weakref.ReferenceType[torch.nn.Module] | None = None
    marks: ModelMarks = field(default_factory=ModelMarks)  # what the graph needs on the model (``marks.py``)
    # The LoRA layers' router, the adapter structure the graph holds and the slots its ``adapter_index`` numbers
    # (``lora_rows.py``); None, (), {} for a model without LoRA layers.
    lora: lora.LoraRouter | None = None
    lora_key: lora_rows.Signature = ()
    slots: dict[str, int] = field(default_factory=dict)
    retired: bool = False  # the model's adapters changed (``retire``): engines make a new graph for them
    kinds: tuple[StepKind, ...] = (StepKind(),)  # the kinds of step its graphs serve, each compiled at start
    options: dict[str, object] = field(default_factory=inductor_options)  # inductor's, for the model's dtype

    def start(
        self,
        device: torch.device,
        thread_counts: Sequence[int] = (),
        background: bool = True,
        child: prewarm.Job | None = None,
    ) -> None:
        """Compile in the background, once (later calls do nothing), one graph at the largest of
        ``thread_counts`` (default the caller's count), which serves steps of every count (``STEP_THREADS``).
        ``background``: beside steps that serve requests, first in a child process where ``child`` is given
        (``prewarm.py``); False: someone waits for it (``wait_compiled``, ``compile="startup"``)."""
        with self.lock:
            if self.thread is not None:
                return
            args = (device, tuple(thread_counts) or (torch.get_num_threads(),), background, child)
            self.weights = fingerprint(self.tensors)
            install_compile_patches()  # before the thread can trace
            release = self.marks.open()  # the trace reads the marks: on the model until the compile ends
            # In the caller's context: torch's inductor and dynamo settings (``config.patch``, or assigned) are
            # per thread (context variables), and a new thread would compile with the defaults, whatever the
            # caller set (a test's ``force_disable_caches`` was ignored: a cached graph served it instead).
            context = contextvars.copy_context()
            self.thread = threading.Thread(target=context.run, args=(self._compile, release, *args),
                                           name="hf_paged_attn-compile", daemon=True)  # fmt: skip
            _COMPILING.add(self.thread)
            self.thread.start()

    def _compile(
        self,
        release: Callable[[], None],
        device: torch.device,
        thread_counts: tuple[int, ...],
        background: bool,
        child: prewarm.Job | None,
    ) -> None:
        # A new thread takes torch's process-wide count at its first query, which an engine step may
        # have set to 1 for a moment: query first, then set (else the set could be undone by the init).
        torch.get_num_threads()
        where = " in the background" + (" (first in a child process at low priority)" if child else "")
        logger.warning(
            "hf_paged_attn: compiling the model's forward%s (once per model and process; steps run eagerly meanwhile; "
            "PagedConfig(compile=False) turns it off)", where if background else ""
        )
        start = time.perf_counter()
        try:
            # Before the trace, so the first graph runs on the copies; before the child, so the eager steps meanwhile
            # run on the float32 ones too (oneDNN's packed sgemm, where F.linear runs MKL's)
            if self.pack and (model := self.model and self.model()) is not None:
                packed_linear.pack(model)
                if packed_linear.holds_copies(model, packed_linear.EAGER_DTYPES):
                    self.packed.set()
            if child is not None:
                child.run()  # fills inductor's disk cache: the compile below then loads its graphs from there
                if _EXITING:
                    raise RuntimeError("the interpreter is exiting")
            with torch.inference_mode():  # as the engine's steps are: dynamo guards on inference tensors
                ids = torch.zeros(1, WARMUP_ROWS, dtype=torch.long, device=device)
                indices = torch.arange(2, device=device)
                adapters = torch.zeros_like(ids) if self.lora is not None else None  # every row the base model
            self.threads = max(thread_counts)
            torch.set_num_threads(self.threads)
            self.regions = keep_stampable(self.regions, self.marks)
            breaks = _graph_breaks()
            refused = None
            try:
                self._warm_up(device, ids, indices, adapters)
            except Exception as exc:
                if not self.regions or _EXITING:
                    raise
                refused = f"{type(exc).__name__}: {exc}"
            if self.regions and refused is None and _graph_breaks() != breaks:
                refused = "a graph break (a region can't break: its whole layer would run eagerly)"
            if refused is not None:  # a layer the regions do not take: trace the layers whole
                logger.warning("hf_paged_attn: compiling with the decoder layers as regions failed (%s); compiling "
                               "without", refused)  # fmt: skip
                unmark_layer_regions(self.regions, self.marks)
                self.regions = []
                self._warm_up(device, ids, indices, adapters)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            if _EXITING:
                logger.debug("hf_paged_attn: the background compile stopped at exit (%s)", self.failed)
            else:
                logger.warning("hf_paged_attn: compiling the model's forward failed (%s); steps run eagerly",
                               self.failed)
        else:
            self.compile_seconds = time.perf_counter() - start
            self.num_compiles += 1
            if self.lora is None and (model := self.model and self.model()) is not None:
                compile_record.record(model, self.threads)  # the next process compiles it at start-up
            logger.warning("hf_paged_attn: compiled the model's forward in %.1f s", self.compile_seconds)
        finally:
            release()
            self.ready.set()
            _COMPILING.discard(threading.current_thread())

    def _warm_up(
        self, device: torch.device, ids: torch.Tensor, indices: torch.Tensor, adapters: torch.Tensor | None
    ) -> None:
        """Runs (and so compiles) the graph of each kind of step on padding rows, which never touch a cache."""
        for kind in self.kinds:
            with torch.inference_mode():
                tokens = ids
                if kind.embeds:
                    model = self.model and self.model()
                    weight = model.get_input_embeddings().weight
                    tokens = torch.zeros(1, ids.shape[1], weight.shape[1], dtype=weight.dtype, device=device)
                shape = ids.shape if kind.position_dims == 2 else (3, *ids.shape)  # [1, M] or [3, 1, M]
                positions = torch.zeros(shape, dtype=torch.long, device=device)
            run_graph(self, CompiledStep(None, None, self.modules, 0), tokens, positions, indices, adapters)

    def stale(self) -> bool:
        """Whether a weight changed since the compile (an optimizer step, a loaded state dict, a
        replaced ``.data``): a graph with frozen weights would compute with the old values. An unfrozen
        graph (``inductor_options``) reads the live ones, but is retired as well: whether dynamo's
        guards catch every replaced parameter was not checked."""
        return fingerprint(self.tensors) != self.weights

    def adapters_changed(self) -> bool:
        """Whether the model's LoRA adapters are no longer those the graph holds (``lora_rows.py``): one was
        loaded or unloaded through an engine (``retire``), or a layer's adapters or scaling changed."""
        return self.retired or (self.lora is not None and lora_rows.signature(self.lora.layers) != self.lora_key)


_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, CompiledModel] = weakref.WeakKeyDictionary()


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module] | None:
    """``layer_idx`` -> attention module, or None when the model's layer indices are not one per
    layer (models that reuse or offset layers, which the op could not address by index)."""
    modules = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "config") and any(
            hasattr(module, name) for name in ("q_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")
        ):
            if idx in modules:
                return None
            modules[idx] = module
    return modules or None


def _device(module: torch.nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


# Decoder layers as nested compile regions (``torch.compiler.nested_compile_region``): dynamo traces the
# first layer and stamps out its graph for every later layer whose inputs and guards match, instead of
# tracing every layer (the 30M model's 8: 5.2 -> 3.4 s of dynamo's trace on a Zen 1 EPYC). Dynamo's own
# guards decide the reuse, so a layer that differs (another window, another MLP) is traced anew. What
# makes the layers alike: the attention op takes the layer's index as a tensor (each attention module's
# ``LAYER_INDEX`` buffer, a graph input), and ``_region_call`` keeps the cache and the ``paged_forward``
# marker (the same objects for every layer) out of the region's inputs, which dynamo reuses only when
# all are tensors, numbers or modules. The graph is flattened again before AOT autograd
# (``inline_invoke_subgraph``), so inductor compiles what it compiled before. A compile that fails with
# the regions is retried without them (``CompiledModel._compile``).
_STATIC = "_hf_paged_region_static"  # a layer's objects kept out of its region's inputs
_ROUTE = "_hf_paged_region_route"  # the context its region's body runs in (``packed_linear.RoutePackedLinears``)


def _region_body(layer: torch.nn.Module, *args: object, **kwargs: object) -> object:
    # A torch function mode is off while it handles a call, the region's among them: the body enters
    # the compiled forward's mode again, or its linears would not reach the packed weights.
    with getattr(layer, _ROUTE)():
        return type(layer).forward(layer, *args, **kwargs, **getattr(layer, _STATIC))


_REGION = torch.compiler.nested_compile_region(_region_body)


def _region_call(layer: torch.nn.Module, *args: object, **kwargs: object) -> object:
    """``layer``'s forward: eagerly its own; while dynamo traces, through the layers' shared region, with
    the static objects (``_STATIC``) taken out of the call when they are the ones the region adds."""
    static = getattr(layer, _STATIC)
    if not torch.compiler.is_compiling() or any(kwargs.get(k) is not v for k, v in static.items()):
        return type(layer).forward(layer, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in static}
    return _REGION(layer, *args, **kwargs)


def mark_layer_regions(
    model: torch.nn.Module,
    modules: dict[int, torch.nn.Module],
    static: dict[str, object],
    route: Callable,
    marks: ModelMarks,
) -> list[torch.nn.Module]:
    """Route ``model``'s decoder layers (the modules that hold an attention module of ``modules`` as a direct
    child) through ``_region_call``; their bodies run under ``route()``. The forwards are ``marks`` (on the
    model only while they are open). Returns the layers."""
    attention = {id(module) for module in modules.values()}
    layers = []
    for layer in model.modules():
        if "forward" in layer.__dict__ or not any(id(child) in attention for child in layer.children()):
            continue  # not a decoder layer, or one with someone else's forward (accelerate's hooks)
        marks.put(layer, _STATIC, static)
        marks.put(layer, _ROUTE, route)
        marks.put(layer, "forward", functools.partial(_region_call, layer))
        layers.append(layer)
    return layers


def _graph_breaks() -> int:
    """Dynamo's graph breaks in this process so far."""
    return torch_private.graph_breaks()


def keep_stampable(layers: list[torch.nn.Module], marks: ModelMarks) -> list[torch.nn.Module]:
    """The regions dynamo can stamp out; the others get their forwards back. A layer holding a module with
    a forward of its own (``fp32_matmuls``' float32 linears, accelerate's hooks) is not one: dynamo guards
    on that callable's identity, which differs per layer, so it would trace every layer and pay for the
    regions besides (the 30M model in bf16 on a CPU without bf16 matmuls: ready 14.1 s against 11.4)."""
    keep = [layer for layer in layers if not any("forward" in m.__dict__ for m in layer.modules() if m is not layer)]
    unmark_layer_regions([layer for layer in layers if all(layer is not k for k in keep)], marks)
    return keep


def unmark_layer_regions(layers: list[torch.nn.Module], marks: ModelMarks) -> None:
    """Give ``layers`` their own forwards back for good (``mark_layer_regions`` undone and forgotten)."""
    for layer in layers:
        marks.forget(layer, ("forward", _STATIC, _ROUTE))


def compiled_model(model: torch.nn.Module, windows: list[int | None]) -> CompiledModel | None:
    """``model``'s compiled forward, made once per model and adapter structure (None: its layers can't be
    addressed)."""
    router = lora.attached(model)
    lora_key = lora_rows.signature(router.layers) if router is not None else ()
    found = _MODELS.get(model)
    if found is not None and found.lora_key == lora_key and not found.adapters_changed():
        return found
    if found is not None:  # a graph of other adapters: its regions (if any) go with it
        unmark_layer_regions(found.regions, found.marks)
    modules = attention_modules(model)
    if modules is None or sorted(modules) != list(range(len(windows))):
        return None
    install_compile_patches()
    model_ref = weakref.ref(model)  # the compiled function must not keep the model alive
    cache = StepCache(windows)
    pack = packed_linear.wanted(model, bool(INDUCTOR_OPTIONS.get("freezing")))
    route = packed_linear.RoutePackedLinears if pack else contextlib.nullcontext

    def forward(
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        logits_indices: torch.Tensor,
        adapter_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if router is not None:  # the LoRA layers read the rows' adapters from the router while traced
            router.index = adapter_index
        # ids [1, N], or image features among the token embeddings [1, N, hidden] (a rank dynamo guards on)
        given = {"input_ids": tokens} if tokens.dim() == 2 else {"inputs_embeds": tokens}
        with route():  # traced away: the graph calls hf_paged_attn::packed_linear where F.linear was
            out = model_ref()(**given, position_ids=position_ids, cache=cache, use_cache=True,
                              paged_forward=COMPILED, logits_to_keep=logits_indices)  # fmt: skip
        if router is not None:
            router.index = None
        return out.logits[0]

    # The op's layer index as a graph input (``function.LAYER_INDEX``), a buffer while the marks are open:
    # the graph's callers (engines, the compile) hold them open.
    marks = marks_for(model)
    for idx, module in modules.items():
        if marks.get(module, LAYER_INDEX) is None and getattr(module, LAYER_INDEX, None) is None:
            marks.put(module, LAYER_INDEX, tensor_index(idx, _device(module)), buffer=True)
    static = {"cache": cache, "paged_forward": COMPILED}
    kinds = step_kinds(model)
    # A second kind of step's graph re-traced the stamped regions and failed in dynamo (a KeyError on the hidden
    # size, the small LLaVA of benchmarks/vlm_generate.py), then compiled without them: go without at once.
    regions = mark_layer_regions(model, modules, static, route, marks) if len(kinds) == 1 else []
    # The index buffers are listed whether or not the marks are open now: the graph reads them too.
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for m in modules.values() if (t := marks.get(m, LAYER_INDEX)) is not None and _absent(t, tensors)]
    graph = torch.compile(forward, backend=_backend)
    found = _MODELS[model] = CompiledModel(graph, modules, tensors, pack=pack, model=model_ref, regions=regions,
                                           marks=marks, lora=router, lora_key=lora_key, kinds=kinds,
                                           slots=router.slots if router is not None else {},
                                           options=inductor_options(model.dtype))  # fmt: skip
    return found


def retire(model: torch.nn.Module) -> None:
    """``model``'s adapters changed (an engine loaded or unloaded one): its compiled forward is retired, and each
    compiled engine on it makes a new one for the adapters it now has (``compiled_model``)."""
    found = _MODELS.pop(model, None)
    if found is not None:
        found.retired = True


def _absent(tensor: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    return all(t is not tensor for t in tensors)


@torch.inference_mode()
def run_graph(
    compiled: CompiledModel,
    step: CompiledStep,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    adapter_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The compiled forward on [1, M] ids (or [1, M, hidden] embeddings: ``StepKind``) and positions ([1, M] or
    [3, 1, M]; M >= 2, ``step.num_tokens`` of them real) and ``logits_indices`` [S >= 2]: logits [S, vocab] as
    the model returns them. The token and sampled counts are dynamic: dynamo specialises sizes 0 and 1, which
    callers pad away. The graph runs with torch's thread count at the call, whatever count it was compiled at
    (``STEP_THREADS``). A model with LoRA layers takes each row's adapter, ``adapter_index`` [1, M]
    (``lora_rows.row_index``)."""
    torch_private.mark_dynamic(tokens, 1)
    torch_private.mark_dynamic(position_ids, position_ids.dim() - 1)
    torch_private.mark_dynamic(logits_indices, 0)
    lora_args = () if adapter_index is None else (adapter_index,)
    if adapter_index is not None:
        torch_private.mark_dynamic(adapter_index, 1)
    # Once the graph exists, dynamo checks only the guards that tell graphs apart, not every
    # parameter and attribute of the model (0.2-0.4 ms a step here).
    skip = compiled.ready.is_set()
    stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip else contextlib.nullcontext()
    token = COMPILED_STEP.set(step)
    want = torch.get_num_threads()
    threads_token = None
    if compiled.threads and want != compiled.threads:  # enter at the compiled count; the graph runs at ``want``
        torch.set_num_threads(compiled.threads)
        threads_token = STEP_THREADS.set(want)
    # The compile settings matter only where a call may compile: patching them costs ~55 us a step (torch's
    # ``config.patch`` builds a class and sets each option), so a step on a graph that exists runs without.
    settings = contextlib.nullcontext() if skip else torch_private.compile_settings(compiled.options)
    try:
        with settings:
            try:
                with stance:
                    return compiled.forward(tokens, position_ids, logits_indices, *lora_args)
            except RuntimeError as exc:  # a step the graph's guards reject: compile for it, checking every guard
                if not skip or "skip_guard_eval_unsafe" not in str(exc):
                    raise
                logger.info("hf_paged_attn: a step needs another graph (%s)", exc)
        with torch_private.compile_settings(compiled.options):
            return compiled.forward(tokens, position_ids, logits_indices, *lora_args)
    finally:
        COMPILED_STEP.reset(token)
        if threads_token is not None:
            STEP_THREADS.reset(threads_token)
            torch.set_num_threads(want)


def compiled_model_of(model: torch.nn.Module) -> CompiledModel | None:
    """``model``'s compiled forward, if an engine made one."""
    return _MODELS.get(model)


def wait_compiled(model: torch.nn.Module, timeout: float | None = None) -> bool:
    """Start ``model``'s background compile if an engine has run on it and it has not started (it
    starts by itself after ``COMPILE_AFTER_STEPS`` steps), and wait until it is done; True when its
    graph is ready (False: no compiled engine ever ran on it, it failed, or ``timeout`` seconds passed)."""
    found = _MODELS.get(model)
    if found is None:
        return False
    found.start(next(model.parameters()).device, background=False)
    return found.ready.wait(timeout) and found.failed is None


class CompiledExecutor:
    """Steps through ``model``'s compiled forward once it is ready; until then (and for the first
    step, beam search, and after a failed compile) through ``eager``. ``wait()`` blocks until the
    compile is done. ``num_compiled_steps`` counts the steps the graph ran; ``compiled.num_compiles``
    the model's compiles (one per model and process)."""

    def __init__(
        self,
        eager: LocalExecutor,
        layers: LayerKinds,
        thread_counts: Sequence[int] = (),
        child: Callable[[], prewarm.Job | None] | None = None,
    ) -> None:
        """``child``: the job of a child process that compiles first, for the background compile (``prewarm.py``),
        made when the compile starts (None: no child)."""
        self.eager = eager
        self.layers = layers
        self.child = child
        self.compiled = compiled_model(eager.model, layers.windows)
        self.num_compiled_steps = 0
        self.num_padded_steps = 0
        # The thread counts its steps run with (``threads.ThreadTunedExecutor`` tries 1 and the engine's):
        # the compile makes one graph at the largest, which runs steps of each (``STEP_THREADS``).
        self.thread_counts = tuple(thread_counts) or (torch.get_num_threads(),)

    @property
    def graph_ready(self) -> bool:
        """Whether steps now run through the compiled graph (its compile is done and did not fail)."""
        return self.compiled is not None and self.compiled.ready.is_set() and self.compiled.failed is None

    @property
    def failed(self) -> str | None:
        return "the model's layers can't be addressed by layer_idx" if self.compiled is None else self.compiled.failed

    def wait(self, timeout: float | None = None) -> bool:
        """Start the compile if it has not started, and wait for it; True when the graph is ready."""
        if self.compiled is None:
            return False
        self.compiled.start(next(self.eager.model.parameters()).device, self.thread_counts, background=False)
        self.compiled.ready.wait(timeout)
        return self.compiled.ready.is_set() and self.compiled.failed is None

    def execute(self, step: StepMetadata) -> torch.Tensor:
        """Logits of the step's sampled rows, [num_sampled, vocab] float32."""
        if self.failed is not None or not self.layers.observed or step.has_beams:
            return self._eager(step)
        if not self.compiled.ready.is_set():
            self.compiled.num_eager_steps += 1
            if self.compiled.num_eager_steps >= COMPILE_AFTER_STEPS:  # a run long enough to pay for it
                job = self.child() if self.child is not None and self.compiled.thread is None else None
                self.compiled.start(step.input_ids.device, self.thread_counts, child=job)
            # the float32 linears multiply by the packed copies the compile made (``RoutePackedLinears``: any other
            # weight goes to F.linear as before)
            route = (packed_linear.RoutePackedLinears(packed_linear.EAGER_DTYPES) if self.compiled.packed.is_set()
                     else contextlib.nullcontext())  # fmt: skip
            with route:
                return self._eager(step)
        if self.compiled.adapters_changed():  # a graph for the adapters the model holds now, compiled as at start
            logger.info("hf_paged_attn: the model's LoRA adapters changed: its forward compiles again for them")
            self.compiled = compiled_model(self.eager.model, self.layers.windows)
            return self.execute(step)
        if self.compiled.stale():
            if self.compiled.pack:  # the graph that multiplied by the packed copies is retired: free them
                packed_linear.unpack(self.eager.model)
                linear_groups.unpack(self.eager.model)
            self.compiled.failed = "the model's weights changed after its compile"
            logger.warning("hf_paged_attn: %s; steps run eagerly (PagedConfig(compile=False) skips the compile for "
                           "models that train between generations)", self.compiled.failed)  # fmt: skip
            return self._eager(step)
        self.eager.prepare(step)
        return self._run(step)

    def _eager(self, step: StepMetadata) -> torch.Tensor:
        with FX_TRACE_LOCK:  # never while a compile (this model's or another's) traces: see the module's docstring
            return self.eager.execute(step)

    def _run(self, step: StepMetadata) -> torch.Tensor:
        n = step.num_tokens
        tokens = step.input_ids if step.inputs_embeds is None else step.inputs_embeds  # [1, N] or [1, N, hidden]
        position_ids, indices = step.position_ids, step.logits_indices  # [1, N] or [3, 1, N]; [S]
        if n < 2:  # a padding row: token 0 at position 0, which the attention op never lets near the cache
            tokens = torch.nn.functional.pad(tokens, (0, 2 - n) if tokens.dim() == 2 else (0, 0, 0, 2 - n))
            position_ids = torch.nn.functional.pad(position_ids, (0, 2 - n))
            self.num_padded_steps += 1
        num_sampled = indices.numel()
        if num_sampled < 2:
            indices = torch.nn.functional.pad(indices, (0, 2 - num_sampled))
        adapters = None  # [1, M]: each row's adapter slot, for a model with LoRA layers
        if self.compiled.lora is not None:
            adapters = lora_rows.row_index(step, self.compiled.slots, tokens.shape[1])
        context = ForwardContext(step, self.eager.backend)
        with self.eager.cache.forward(context):
            logits = run_graph(self.compiled, CompiledStep(context, self.eager.cache, self.compiled.modules, n),
                               tokens, position_ids, indices, adapters)  # fmt: skip
        self.num_compiled_steps += 1
        return logits[:num_sampled].float()

    def close(self) -> None:
        pass
