"""Tensor parallelism: one engine across the ranks of a model that transformers sharded with
``from_pretrained(..., tp_plan="auto")`` under ``torchrun``.

Rank 0 (the *driver*) owns intake, scheduling and sampling: it is an ordinary engine whose
executor (``TensorParallelExecutor``) first sends each step to the other ranks (the *workers*). A
step's message is the step's description (``StepMetadata``, its tensors on the CPU; its
copy-on-write block copies travel in it); each worker copies its blocks and runs the same forward
on its shard, its cache holding only its own K/V heads. Only rank 0 samples, so sampling uses one
generator whatever the ranks' random states; the tokens reach the workers as the next step's ``input_ids``.

Messages go over a gloo group of their own (CPU, whatever the model's backend), so a worker can
wait between requests for as long as the server idles, and never mixes a message up with the
model's own collectives. Around each forward, two flags are all-reduced: "ready" (every rank
prepared the step) and "done" (every rank finished it). A rank that raised makes every rank skip
or discard that step, and rank 0 fails the step's requests, as one process would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import signal
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..attention.cache import PagedAttentionCache
from ..attention.step import StepMetadata
from ..core.layers import LayerKinds
from ..kernels import load_backend
from ..kernels.base import AttentionBackend
from ..kernels.kv_dtype import KV_CACHE_DTYPES
from ..runtime.config import PagedConfig
from ..runtime.executor import LocalExecutor
from ..runtime.launcher import CacheSize
from ..runtime.model import lora, memory
from ..runtime.model.kv_scales import kv_scales_for
from ..runtime.model.marks import marks_for
from ..runtime.model.placement import input_device

T = TypeVar("T")
# Workers wait on the control group between requests: as long as a server may idle, not gloo's 30 min.
IDLE_TIMEOUT = timedelta(days=365)


# ----------------------------------------------------------------------------- who is what
def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded over several ranks (``from_pretrained(..., tp_plan=...)``)."""
    return dist.is_available() and dist.is_initialized() and (getattr(model, "tp_size", None) or 1) > 1


def is_driver(model: torch.nn.Module) -> bool:
    """True on rank 0 of a tensor-parallel model, and always for a model in one process."""
    return not is_tensor_parallel(model) or dist.get_rank() == 0


class RankError(RuntimeError):
    """Another rank raised while running a step; the message names the rank(s) and the error."""


# ----------------------------------------------------------------------------- the channel
class ControlChannel:
    """Rank 0 to the other ranks: one pickled message per ``send``, on a gloo group of its own."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.listening = False  # rank 0: the workers are in run_worker, waiting for messages
        self.session: object | None = None  # rank 0: the engine the workers follow now
        self.outcome: Any = None  # workers: what the last "stop" message carried

    def send(self, *message: object) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> tuple:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def check(self, error: BaseException | None) -> None:
        """Every rank calls it with what it raised (or None): raises the same on every rank if any
        rank raised (rank 0's own exception when it raised itself), else returns."""
        flag = torch.tensor([error is not None], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return
        texts: list[str | None] = [None] * self.world_size
        dist.all_gather_object(texts, None if error is None else f"{type(error).__name__}: {error}", group=self.group)
        if self.rank == 0 and error is not None:
            raise error
        failed = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t is not None)
        raise RankError(f"the step failed on another rank ({failed})")

    def release(self, outcome: object = None) -> None:
        """Rank 0: end the workers' ``run_worker`` (once), handing them ``outcome``."""
        if self.listening:
            self.listening, self.session = False, None
            self.send("stop", outcome)


_channel: ControlChannel | None = None


def setup(model: torch.nn.Module) -> ControlChannel:
    """The process's control channel (made once) with ``model`` ready for paged steps; every rank
    calls it at the same point, since both are collective."""
    global _channel
    size, world = model.tp_size, dist.get_world_size()
    if size != world:
        raise ValueError(
            f"the paged engine runs tensor parallel over the whole world: tp_size={size}, world size {world}"
        )
    if _channel is None:
        _channel = ControlChannel()
    replicate_kv_heads(model)
    return _channel


def run_step(channel: ControlChannel, prepare: Callable[[], None], forward: Callable[[], T]) -> T:
    """One step on every rank: ``prepare`` (rank-local, e.g. block copies), then ``forward`` (the
    model, whose collectives pair up across ranks). If any rank raises in either part, every rank
    raises (``RankError``, or rank 0's own exception). An exception raised on one rank only in the
    middle of the forward's collectives can't be caught this way: the other ranks wait in the
    collective (see docs/architecture.md, "Tensor parallelism")."""
    channel.check(_attempt(prepare))
    result: list[T] = []
    channel.check(_attempt(lambda: result.append(forward())))
    return result[0]


def _attempt(fn: Callable[[], object]) -> Exception | None:
    try:
        fn()
    except Exception as exc:  # reported to every rank by ControlChannel.check
        return exc
    return None


# ----------------------------------------------------------------------------- K/V heads
def kv_heads(model: torch.nn.Module) -> tuple[int, int]:
    """(K/V heads of the model, K/V heads each rank holds): ``heads / tp`` when they divide, else 1
    (each rank holds the one head its query heads read, see ``replicate_kv_heads``)."""
    text = model.config.get_text_config()
    total = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    size = getattr(model, "tp_size", None) or 1
    return total, (total // size if total % size == 0 else 1)


def replicate_kv_heads(model: torch.nn.Module) -> None:
    """With fewer K/V heads than ranks, give each rank the K/V head its query heads read, as vLLM does.

    ``tp_plan="auto"`` shards ``k_proj``/``v_proj`` column-wise, which splits a K/V head across ranks
    when there are fewer heads than ranks (and the attention's reshape fails). Here each rank gathers
    the full projection (a collective) and keeps the rows of head ``rank * heads // tp``: rank ``r``
    holds query heads ``[r * H / tp, (r + 1) * H / tp)``, which all read that head when ``tp`` is a
    multiple of the K/V heads. The projections become plain local layers. Idempotent."""
    from torch.distributed.tensor import DTensor

    text = model.config.get_text_config()
    total, _ = kv_heads(model)
    size, heads = model.tp_size, text.num_attention_heads
    if total % size == 0:
        return
    if size % total or heads % size:
        raise ValueError(
            f"can't place {total} K/V heads and {heads} query heads on {size} ranks: the ranks must be a "
            "multiple of the K/V heads and divide the query heads"
        )
    head = dist.get_rank() * total // size  # the K/V head this rank's query heads read
    for module in model.modules():
        k_proj, v_proj = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        if not isinstance(getattr(module, "layer_idx", None), int) or k_proj is None or v_proj is None:
            continue
        head_dim = getattr(module, "head_dim", None) or text.hidden_size // heads
        for proj in (k_proj, v_proj):
            base = proj.get_base_layer() if hasattr(proj, "get_base_layer") else proj  # under a PEFT LoRA layer
            if not getattr(base, "_paged_head_local", False):
                _keep_head(base, head, head_dim)
            # PEFT shards a LoRA B as its base was, column-wise: B keeps the base's head's rows instead. Every
            # setup looks, for adapters loaded (on every rank) since the last one.
            for lora_b in getattr(proj, "lora_B", {}).values():
                if isinstance(lora_b.weight, DTensor):
                    _keep_head(lora_b, head, head_dim)
        module.num_key_value_groups = heads // size  # local query heads per local K/V head (eager/sdpa)


def _keep_head(linear: torch.nn.Module, head: int, head_dim: int) -> None:
    """``linear`` (a K/V projection, or a LoRA B over one) as a plain local layer of head ``head``'s output rows
    (gathered first where sharded: a collective)."""
    from torch.distributed.tensor import DTensor

    for name in ("weight", "bias"):
        param = getattr(linear, name, None)
        if param is None:
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param  # [total * head_dim, ...]
        local = full[head * head_dim : (head + 1) * head_dim].detach().clone()
        setattr(linear, name, torch.nn.Parameter(local, requires_grad=False))
    linear.out_features = head_dim
    linear.__dict__.pop("forward", None)  # drop the column-wise hook: the output is this rank's head
    linear._paged_head_local = True


def rank_blocks(model: torch.nn.Module, config: PagedConfig) -> int:
    """What this rank's memory holds, as one process sizes its cache (``memory.fitting_blocks``), but
    for the K/V heads this rank holds: the config's head count is the whole model's."""
    _, local = kv_heads(model)
    layers = LayerKinds.from_config(model.config, share_pages=config.hybrid_kv)  # one device per rank
    return memory.fitting_blocks(model, config, layers, num_kv_heads=local)


# ----------------------------------------------------------------------------- rank 0
class TensorParallelLauncher:
    """Sets rank 0's engine up: the workers hear the config, the ranks agree on the cache size, and
    the executor broadcasts every step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.channel = setup(model)
        if self.channel.rank != 0:
            raise ValueError(
                f"this is rank {self.channel.rank}: the engine of a tensor-parallel model runs on rank 0; "
                "call hf_paged_attn.parallel.run_worker(model) on the other ranks"
            )
        if self.channel.session is not None:
            raise ValueError("another tensor-parallel engine is running: shut it down first (engine.shutdown())")

    def cache_size(
        self, model: torch.nn.Module, config: PagedConfig, layers: LayerKinds, num_blocks: int | None
    ) -> CacheSize:
        channel = self.channel
        candidate = num_blocks or rank_blocks(model, config)
        channel.listening, channel.session = True, self
        channel.send("hello", config)
        try:
            agreed = channel.agree_min(candidate)
        except Exception:
            channel.release()  # the workers must not wait for an engine that will never step
            raise
        return CacheSize(agreed, agreed)

    def executor(
        self,
        model: torch.nn.Module,
        cache: PagedAttentionCache,
        backend: AttentionBackend,
        config: PagedConfig,
        layers: LayerKinds,
        size: CacheSize,
    ) -> TensorParallelExecutor:
        return TensorParallelExecutor(LocalExecutor(model, cache, backend), self.channel, self)


class TensorParallelExecutor:
    """Rank 0's forwards: each step goes to the workers first, then every rank runs its shard; a rank
    that raises makes every rank raise (``run_step``)."""

    def __init__(self, local: LocalExecutor, channel: ControlChannel, session: object) -> None:
        self.local = local
        self.channel = channel
        self.session = session  # what the channel knows this engine's launcher as

    def execute(self, step: StepMetadata) -> torch.Tensor:
        if self.channel.session is not self.session:
            raise RuntimeError("this tensor-parallel engine has been shut down")
        self.channel.send("step", moved(step, torch.device("cpu")))
        return run_step(self.channel, lambda: self.local.prepare(step), lambda: self.local.forward(step))

    def close(self) -> None:
        """End the workers' loop (their ``run_worker`` returns). Idempotent."""
        if self.channel.session is self.session:
            self.channel.release()


def claim(model: torch.nn.Module) -> TensorParallelLauncher | None:
    """``launcher.LAUNCHERS``' entry: the tensor-parallel launcher for a model sharded over ranks."""
    return TensorParallelLauncher(model) if is_tensor_parallel(model) else None


def moved(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it on ``device``: tensors, lists and tuples of them, dataclasses."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})  # fmt: skip
    return value


# ----------------------------------------------------------------------------- other ranks
@dataclasses.dataclass(slots=True)
class WorkerReport:
    """What a worker did in one ``run_worker`` call."""

    num_blocks: int
    num_steps: int = 0
    num_failed_steps: int = 0
    kv_bytes: int = 0  # bytes of this rank's K/V pages


def run_worker(model: torch.nn.Module) -> WorkerReport | None:
    """Run rank 0's steps on this rank's shard until rank 0 shuts its engine down (every rank but 0
    calls it once per engine of rank 0). Returns what this rank did, or None if rank 0 stopped
    before building an engine. A ``PeftModel`` runs its base model, each step's rows under their
    adapters (``runtime/model/lora.py``)."""
    model = lora.base_of(model)
    channel = setup(model)
    if channel.rank == 0:
        raise ValueError("run_worker runs on the ranks other than 0; rank 0 builds the engine")
    message = channel.receive()
    if message[0] == "stop":
        channel.outcome = message[1]
        return None
    config: PagedConfig = message[1]
    num_blocks = channel.agree_min(rank_blocks(model, config))
    device = input_device(model)
    layers = LayerKinds.from_config(model.config, share_pages=config.hybrid_kv)
    scales = kv_scales_for(model, config.kv_cache_dtype, len(layers.windows))  # each rank holds every layer's
    cache = PagedAttentionCache(model.config, num_blocks, config.block_size, layers,
                                KV_CACHE_DTYPES[config.kv_cache_dtype], scales)  # fmt: skip
    local = LocalExecutor(model, cache, load_backend(config.kernel, device))
    report = WorkerReport(num_blocks)
    # LoRA adapters: this rank's shards run each step's rows under their requests' adapters, as on rank 0
    release = marks_for(model).open()
    try:
        router = lora.attach(model, marks_for(model))
        while (message := channel.receive())[0] == "step":
            step: StepMetadata = moved(message[1], device)
            try:
                with router.step(step) if router is not None else contextlib.nullcontext():
                    run_step(channel, lambda step=step: local.prepare(step), lambda step=step: local.forward(step))
                report.num_steps += 1
            except Exception:  # rank 0 fails the step's requests; the worker carries on
                report.num_failed_steps += 1
    finally:
        release()
    channel.outcome = message[1]
    report.kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)
    return report


def serve_worker(model: torch.nn.Module) -> WorkerReport | None:
    """``hf-paged-attn serve --tp-plan auto`` on a rank other than 0: rank 0's steps until its server
    stops. SIGTERM and SIGINT, which torchrun (or a terminal) sends every rank, are ignored here:
    rank 0 drains its requests first, and its engine's shutdown then ends this loop."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return run_worker(model)


def leave() -> None:
    """End this process's part in tensor parallelism, its engines done (every rank, at the end of
    ``hf-paged-attn serve``): destroys its process groups, the control channel's among them. Left to the
    interpreter's exit, gloo's threads could abort the process ("terminate called without an active
    exception", status 134: one exit in ~8 on a loaded 2-core machine). Nothing without a process group."""
    global _channel
    _channel = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- every rank
def on_driver(model: torch.nn.Module, fn: Callable[[], T]) -> T:
    """``fn()`` for a model in one process. For a tensor-parallel model, every rank calls it with
    the same ``fn``: rank 0 runs ``fn`` (its engines drive the others), the other ranks run its
    forwards meanwhile, and every rank returns ``fn``'s result, or raises its exception."""
    if not is_tensor_parallel(model):
        return fn()
    channel = setup(model)
    if channel.rank != 0:
        run_worker(model)
        kind, value = channel.outcome or ("error", RuntimeError("rank 0 ended the engine without a result"))
        if kind == "error":
            raise value
        return value
    channel.listening = True
    outcome: tuple[str, object] = ("error", RuntimeError("rank 0 was interrupted"))
    try:
        result = fn()
        outcome = ("ok", result)
        return result
    except Exception as exc:
        outcome = ("error", _picklable(exc))
        raise
    finally:
        channel.release(outcome)


def _picklable(exc: Exception) -> Exception:
    """``exc``, or a RuntimeError with its text when it can't travel to the other ranks."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
