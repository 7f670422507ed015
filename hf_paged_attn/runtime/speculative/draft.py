"""Proposals from a draft model, run by the engine in the same step as the target, on a paged cache
of its own that is addressed by the target's block ids.

The draft's ``PagedAttentionCache`` has pages shaped for the draft model and as many of them as the
target's cache; a request's draft K/V at position ``i`` sits in the slot the target's table of a
full-attention group gives position ``i`` (vLLM's design). So admission, reservation, rollback and
release of blocks are the target's and the draft needs none of its own: when the target gives a
rejected token's block back, the draft's K/V there goes with it.

Each request records how far the draft has computed (``SpecState.draft_computed``); what lies past
the target's own ``num_computed_tokens`` was rejected and is recomputed. A step's proposals are:
one forward that catches the draft up on the tokens it has not seen (the last step's accepted
tokens and bonus; after admission or preemption the whole sequence, in chunks of the step budget)
and samples ``d1``, then ``k - 1`` one-token decode steps. The draft writes only positions the
target reserved this step or computed before; a block it shares with another request (a prefix
hit, a fork) gets the same K/V the other request's draft wrote there, from the same tokens.

Draft K/V only ever changes proposals, never the output: the target verifies every token.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ... import transformers_private as hf
from ...attention.cache import PagedAttentionCache
from ...attention.model_checks import check_paged_model
from ...attention.step import build_step
from ...core.layers import LayerKinds
from ...core.request import Request
from ...core.scheduler import ScheduledRequest
from ...kernels.base import AttentionBackend
from ..cpu import fp32_matmuls
from ..executor import LocalExecutor
from ..generation.argmax import row_argmax
from ..generation.sampling import draw
from ..model.marks import marks_for
from ..model.placement import input_device


@dataclass(slots=True)
class _Feed:
    """What ``build_step`` reads of a request, as the draft sees it: ``tokens`` fed from position
    ``num_computed_tokens``, into the slots of ``block_tables[0]`` (the target's table)."""

    num_computed_tokens: int
    tokens: list[int]
    block_tables: list[list[int]]
    group: None = None
    adapter: None = None  # the draft model has no LoRA adapters: it proposes as its base
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = self.num_computed_tokens + len(self.tokens)

    def token_slice(self, start: int, n: int) -> list[int]:
        offset = start - self.num_computed_tokens
        return self.tokens[offset : offset + n]


@contextlib.contextmanager
def paged_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with ``attn_implementation="paged"`` inside the block, its own outside: transformers'
    ``generate(assistant_model=...)`` takes an assistant loaded with any attention."""
    before = hf.attn_implementation(model)
    if before == "paged":
        yield model
        return
    model.set_attn_implementation("paged")
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def full_attention_group(layers: LayerKinds) -> int:
    """The first attention group of the target without a sliding window: its tables hold every
    block of a request, so they can address the draft's K/V. ValueError when there is none."""
    for index, group in enumerate(layers.groups):
        if group.window is None:
            return index
    raise ValueError(
        "a draft model needs a target with full-attention layers: its block tables address the draft's K/V; "
        f"every layer of this target slides a window ({[g.window for g in layers.groups]})"
    )


class DraftProposer:
    """The draft model, its cache (``num_pages`` pages of ``block_size`` tokens) and executor."""

    def __init__(
        self,
        model: torch.nn.Module,
        target: torch.nn.Module,
        target_layers: LayerKinds,
        num_pages: int,
        block_size: int,
        backend: AttentionBackend,
        max_batch_tokens: int,
    ) -> None:
        check_paged_model(model, hf.attn_implementation(model), "draft model")
        vocab, target_vocab = (m.config.get_text_config().vocab_size for m in (model, target))
        if vocab != target_vocab:
            raise ValueError(
                f"the draft model's vocabulary has {vocab} tokens, the target's {target_vocab}: a draft must "
                "share the target's tokenizer and vocabulary"
            )
        self.group = full_attention_group(target_layers)
        self.model = model
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.target_layers = target.config.get_text_config().num_hidden_layers
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.device = input_device(model)
        # One table for all the draft's layers (the target's): a sliding draft layer masks by its window.
        self.layers = LayerKinds.from_config(model.config, share_pages=False)
        self.cache = PagedAttentionCache(model.config, num_pages, block_size, self.layers)
        # The draft's marks are on it while the engine runs (``close``), as the target's are.
        self._release_marks = weakref.finalize(self, marks_for(model).open())
        if fp32_matmuls.installed(target):  # the target computes its linears in float32: so does its draft
            fp32_matmuls.install(model, marks_for(model))
        self.executor = LocalExecutor(model, self.cache, backend)

    def close(self) -> None:
        """Take the draft's marks (its float32 linears) off it. Idempotent."""
        self._release_marks()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """The target's copy-on-write copies, done on the draft's pages too."""
        self.cache.copy_blocks(pairs)

    @torch.inference_mode()
    def propose(self, items: list[tuple[Request, int]], generator: torch.Generator) -> None:
        """``k`` proposals for each (decoding request, k) in ``request.draft_ids``; sampled
        requests also get the draft's probabilities of them in ``request.speculation.q`` [k, vocab]."""
        feeds = []
        for request, _ in items:
            start = request.speculation.draft_start(request)
            tokens = request.token_slice(start, request.num_tokens - start)
            feeds.append(_Feed(start, tokens, [request.block_tables[self.group]]))
        logits = self._catch_up(feeds)  # [len(items), vocab]: after each request's last token
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        active = list(range(len(items)))
        for j in range(max(k for _, k in items)):
            if j:  # feed d_j, get the logits after it
                active = [i for i in active if items[i][1] > j]
                feeds = [
                    _Feed(items[i][0].num_tokens - 1 + j, [drafts[i][-1]], [items[i][0].block_tables[self.group]])
                    for i in active
                ]
                logits = self._forward(feeds, [True] * len(feeds))
            for i, token, prob in zip(active, *self._sample(logits, [items[i][0] for i in active], generator)):
                drafts[i].append(token)
                if prob is not None:
                    probs[i].append(prob)
        for (request, k), draft, q in zip(items, drafts, probs):
            request.draft_ids = draft
            request.speculation.q = torch.stack(q) if q else None
            request.speculation.draft_computed = request.num_tokens - 1 + k  # fed: up to d_{k-1}

    def _catch_up(self, feeds: list[_Feed]) -> torch.Tensor:
        """Feed every request's unseen tokens, in steps of at most ``max_batch_tokens``; the logits
        after each one's last token, [len(feeds), vocab]."""
        out: list[torch.Tensor | None] = [None] * len(feeds)
        left = list(range(len(feeds)))
        while left:
            budget, chunk = self.max_batch_tokens, []
            for i in left:
                n = min(len(feeds[i].tokens), budget)
                if n == 0:
                    break
                chunk.append((i, n))
                budget -= n
            parts = [_Feed(feeds[i].num_computed_tokens, feeds[i].tokens[:n], feeds[i].block_tables) for i, n in chunk]
            done = [n == len(feeds[i].tokens) for i, n in chunk]
            logits = self._forward(parts, done)
            rows = iter(logits)
            for (i, n), last in zip(chunk, done):
                if last:
                    out[i] = next(rows)
                else:
                    feeds[i] = _Feed(feeds[i].num_computed_tokens + n, feeds[i].tokens[n:], feeds[i].block_tables)
            left = [i for i in left if out[i] is None]
        return torch.stack(out)

    def _forward(self, feeds: list[_Feed], sampled: list[bool]) -> torch.Tensor:
        scheduled = [ScheduledRequest(feed, len(feed.tokens)) for feed in feeds]  # type: ignore[arg-type]
        step = build_step(scheduled, self.block_size, self.device, self.layers, sampled=sampled)
        logits = self.executor.execute(step)
        if not self.layers.observed:
            self.layers.observe(self.cache.observed_windows())
        return logits

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], generator: torch.Generator
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """The draft's token per row: greedy requests its argmax, sampled ones a draw from their
        processed distribution (returned too: the verifier's ``q``)."""
        tokens = row_argmax(logits).tolist()
        probs: list[torch.Tensor | None] = [None] * len(requests)
        for row, request in enumerate(requests):
            params = request.sampling
            if not params.do_sample:
                continue
            scores = logits[row : row + 1]
            if params.plan.steps:
                ids = torch.empty(1, 0, dtype=torch.long, device=scores.device)
                scores = params.plan.row_free_tail(ids, scores.clone())
            prob = torch.softmax(scores, dim=-1)
            tokens[row] = int(draw(prob, params.generator or generator))
            probs[row] = prob[0]
        return tokens, probs
