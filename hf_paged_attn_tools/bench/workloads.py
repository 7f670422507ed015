"""Seeded, deterministic workloads and the random-weight model they run on.

Every system of a benchmark run sees exactly the same prompts and per-request ``max_new_tokens``
(EOS is disabled, so every request generates exactly its ``max_new_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LlamaConfig

from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn_tools.testing import save_random_model

BLOCK_SIZE = 8  # PagedConfig's default on CPU (docs/performance.md: block size)
MAX_BATCH_TOKENS = 512


@dataclass(frozen=True)
class ModelSpec:
    """A Llama shape with random weights (``initializer_range`` 0.1 so greedy tokens vary)."""

    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=0.1,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,  # EOS disabled: every request runs to its max_new_tokens
        )

    def save(self, directory: str, seed: int = 0) -> str:
        """``save_pretrained`` a random-weight model into ``directory`` and return it."""
        return save_random_model(self.config(), directory, seed=seed)


FULL_MODEL = ModelSpec()
SMOKE_MODEL = ModelSpec(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)


@dataclass
class Workload:
    """Requests plus the knobs every system is run with.

    Attributes:
        name: workload name (also the stem of the result files).
        model: the model shape.
        prompts: token ids of each request's prompt.
        max_new_tokens: new tokens of each request.
        num_blocks: KV blocks of ``BLOCK_SIZE`` tokens given to both paged systems.
        concurrency: the ``max_num_seqs`` / batch sizes of the throughput sweep.
        headline: concurrency of the headline figures, per system kind ("continuous", "static").
        shared_prefix: length of the prefix all prompts share (0: none).
    """

    name: str
    model: ModelSpec
    prompts: list[list[int]]
    max_new_tokens: list[int]
    num_blocks: int
    concurrency: list[int]
    headline: dict[str, int]
    shared_prefix: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def new_tokens(self) -> int:
        return sum(self.max_new_tokens)

    @property
    def unique_prompt_tokens(self) -> int:
        """Prompt tokens with the shared prefix counted once (what perfect prefix caching computes)."""
        return self.prompt_tokens - self.shared_prefix * max(self.num_requests - 1, 0)

    def describe(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prompt_len_min_max": [min(lens), max(lens)],
            "max_new_tokens_min_max": [min(self.max_new_tokens), max(self.max_new_tokens)],
            "shared_prefix": self.shared_prefix,
            "num_blocks": self.num_blocks,
            "block_size": BLOCK_SIZE,
            "max_batch_tokens": MAX_BATCH_TOKENS,
            "concurrency": self.concurrency,
            "headline": self.headline,
            "model": _spec_dict(self.model),
            **self.meta,
        }


def _spec_dict(spec: ModelSpec) -> dict[str, int]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def blocks_to_fit(prompts: list[list[int]], max_new_tokens: list[int]) -> int:
    """Blocks that hold every request at full length at once (no preemption possible)."""
    return sum(blocks_for(len(p) + n, BLOCK_SIZE) for p, n in zip(prompts, max_new_tokens))


def _draw(gen: torch.Generator, low: int, high: int, count: int) -> list[int]:
    return torch.randint(low, high + 1, (count,), generator=gen).tolist()


def _tokens(gen: torch.Generator, vocab: int, count: int) -> list[int]:
    return torch.randint(1, vocab, (count,), generator=gen).tolist()  # 0 is the pad token


def uniform(num_requests: int = 64, seed: int = 0, model: ModelSpec = FULL_MODEL, name: str = "uniform",
            num_blocks: int | None = None) -> Workload:
    """Prompts of 16-256 tokens, 8-128 new tokens, both uniform."""
    gen = torch.Generator().manual_seed(seed)
    lengths = _draw(gen, 16, 256, num_requests)
    new = _draw(gen, 8, 128, num_requests)
    prompts = [_tokens(gen, model.vocab_size, n) for n in lengths]
    return Workload(
        name=name, model=model, prompts=prompts, max_new_tokens=new,
        num_blocks=num_blocks or blocks_to_fit(prompts, new),
        concurrency=[1, 4, 16, 64], headline={"continuous": 64, "static": 16},
    )


def shared_prefix(num_requests: int = 64, prefix_len: int = 512, seed: int = 0,
                  model: ModelSpec = FULL_MODEL) -> Workload:
    """One shared ``prefix_len``-token prefix, a 16-64-token suffix each, 32 new tokens."""
    gen = torch.Generator().manual_seed(seed)
    prefix = _tokens(gen, model.vocab_size, prefix_len)
    prompts = [prefix + _tokens(gen, model.vocab_size, n) for n in _draw(gen, 16, 64, num_requests)]
    new = [32] * num_requests
    return Workload(
        name="shared-prefix", model=model, prompts=prompts, max_new_tokens=new,
        num_blocks=blocks_to_fit(prompts, new), concurrency=[1, 4, 16, 64],
        headline={"continuous": 64, "static": 16}, shared_prefix=prefix_len,
    )


def scale(num_requests: int = 1024, num_blocks: int = 8192 // BLOCK_SIZE, seed: int = 1) -> Workload:
    """``uniform``'s distribution at 1,024 requests with a fixed cache of ``num_blocks`` blocks
    (8,192 tokens: fewer than 64 running requests can hold at full length, so preemption is exercised)."""
    work = uniform(num_requests, seed=seed, name="scale", num_blocks=num_blocks)
    work.concurrency = [64]
    work.headline = {"continuous": 64, "static": 16}
    return work


def smoke(seed: int = 0) -> Workload:
    """Tiny model, 6 requests of 8 new tokens: seconds, for tests and CI."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [_tokens(gen, SMOKE_MODEL.vocab_size, n) for n in _draw(gen, 4, 40, 6)]
    new = [8] * 6
    return Workload(
        name="smoke", model=SMOKE_MODEL, prompts=prompts, max_new_tokens=new,
        num_blocks=blocks_to_fit(prompts, new), concurrency=[1, 6], headline={"continuous": 6, "static": 6},
    )


WORKLOADS = {"uniform": uniform, "shared-prefix": shared_prefix, "scale": scale, "smoke": smoke}


def demo_prompts(tokenizer, num: int, seed: int = 0) -> list[list[int]]:  # noqa: ANN001
    """``num`` prompts of 4-62 tokens (seeded) for the bundled model: its demo prompts in a shuffled order,
    cut. Each starts at a sentence start; none shares the 32 leading tokens that would make the engine's
    decode treat it as a shared prefix (that path has its own workload, ``shared-prefix``)."""
    import random

    from hf_paged_attn.demo import PROMPTS

    rng = random.Random(seed)
    out = []
    for _ in range(num):
        order = rng.sample(PROMPTS, len(PROMPTS))
        out.append(tokenizer(" ".join(order))["input_ids"][: rng.randint(4, 62)])
    return out
