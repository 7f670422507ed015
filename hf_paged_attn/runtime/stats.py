"""What the engine reports about itself (``engine.stats``), and the counters behind it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.kv_manager import KVBlockManager
    from ..core.scheduler import Scheduler


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int  # the allocator's blocks, each holding block_size tokens of ``layers_per_block`` layers
    num_free_blocks: int
    peak_used_blocks: int
    num_preemptions: int
    num_steps: int
    num_generated_tokens: int
    tokens_per_second: float
    busy_seconds: float  # inside step()
    forward_seconds: float  # inside the model forward (the rest is the engine's own overhead)
    kv_waste_at_peak: float  # reserved but unfilled slots / reserved slots, when most blocks were used
    num_prompt_tokens: int  # of admitted requests
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # Layers one block holds: all of them, or one attention group's when a hybrid model's groups
    # share the pool; ``num_blocks * layers_per_block / num_layers`` is PagedConfig.num_blocks' unit
    layers_per_block: int = 0
    # Tokens each attention group's tables can hold now (``KVBlockManager.token_capacity``): what
    # they hold plus the whole free pool, which the groups share. One entry with one table.
    token_capacity_per_group: tuple[int, ...] = ()
    kv_cache_dtype: str = ""  # what the pages store: the model's dtype, or float8_e4m3fn / float8_e5m2
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted (each step emits them and one more token)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of the proposed tokens the target accepted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(slots=True)
class StepCounters:
    """Running totals the engine adds to as it steps."""

    num_steps: int = 0
    num_generated_tokens: int = 0
    busy_seconds: float = 0.0
    forward_seconds: float = 0.0
    peak_used_blocks: int = 0
    kv_waste_at_peak: float = 0.0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    waste_measured_at: int = 0  # blocks in use when kv_waste_at_peak was last measured

    def track_peak(self, num_used_blocks: int, waste: Callable[[], float]) -> None:
        """A new peak of blocks in use: record it, and how much of it is unfilled (``waste()``
        walks every block table, so it is measured again only once the peak has grown by 1%: the
        figure belongs to a peak within 1% of the highest)."""
        if num_used_blocks > self.peak_used_blocks:
            self.peak_used_blocks = num_used_blocks
            if num_used_blocks >= self.waste_measured_at + max(1, self.waste_measured_at // 100):
                self.kv_waste_at_peak = waste()
                self.waste_measured_at = num_used_blocks

    def snapshot(
        self, scheduler: Scheduler, kv: KVBlockManager, num_incoming: int, kv_cache_dtype: str = ""
    ) -> EngineStats:
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + num_incoming,
            num_blocks=kv.allocator.num_blocks,
            num_free_blocks=kv.allocator.num_free_blocks,
            peak_used_blocks=self.peak_used_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            tokens_per_second=self.num_generated_tokens / self.busy_seconds if self.busy_seconds else 0.0,
            busy_seconds=self.busy_seconds,
            forward_seconds=self.forward_seconds,
            kv_waste_at_peak=self.kv_waste_at_peak,
            num_prompt_tokens=kv.num_prompt_tokens,
            num_cached_tokens=kv.num_cached_tokens,
            layers_per_block=kv.layers.layers_per_block,
            token_capacity_per_group=tuple(kv.token_capacity()),
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            kv_cache_dtype=kv_cache_dtype,
        )
