"""What the engine reports about itself (``engine.stats``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
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

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
