"""Speculative decoding's parts, each against its definition: prompt lookup against transformers'
``PromptLookupCandidateGenerator``, rejection sampling against the target distribution (chi-square
on many draws from synthetic p and q), the adaptive choice of k, the step
description with proposals, ``KVBlockManager.trim``, the torch backend's in-place multi-query rows."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from hf_paged_attn.attention.step import build_step
from hf_paged_attn.core.blocks import BlockAllocator
from hf_paged_attn.core.kv_manager import KVBlockManager
from hf_paged_attn.core.request import Request
from hf_paged_attn.core.scheduler import ScheduledRequest, Scheduler
from hf_paged_attn.kernels import reference, torch_backend
from hf_paged_attn.kernels.base import AttentionOptions
from hf_paged_attn.runtime.speculative.adaptive import Acceptance, allocate
from hf_paged_attn.runtime.speculative.config import SpeculativeConfig
from hf_paged_attn.runtime.speculative.ngram import NgramIndex
from hf_paged_attn.runtime.speculative.verify import accept_greedy, rejection_sample


# ---------------------------------------------------------------------------------- prompt lookup
def transformers_candidates(tokens: list[int], k: int, max_n: int, eos: list[int] | None) -> list[int]:
    generator = PromptLookupCandidateGenerator(
        eos_token_id=torch.tensor(eos) if eos else None, num_output_tokens=k, max_matching_ngram_size=max_n,
        max_length=len(tokens) + k + 2,
    )  # fmt: skip
    ids = torch.tensor([tokens])
    out, _ = generator.get_candidates(ids)
    return out[0, len(tokens) :].tolist()


@pytest.mark.parametrize("max_n", [1, 2, 3])
def test_ngram_proposals_are_transformers_candidates(max_n):
    """Random sequences over small alphabets (many repeats), grown token by token as a request's
    output grows: every proposal equals transformers' candidates for the same sequence."""
    rng = random.Random(max_n)
    checked = proposed = 0
    for _ in range(60):
        alphabet = rng.randint(2, 6)
        prompt = [rng.randrange(alphabet) for _ in range(rng.randint(1, 12))]
        request = Request("r", prompt, 64, None, 0)
        index = NgramIndex(max_n)
        eos = [rng.randrange(alphabet)] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 20)):
            k = rng.randint(1, 6)
            index.extend(request)
            got = index.propose(k, set(eos))
            assert got == transformers_candidates(request.all_ids, k, max_n, eos), (request.all_ids, k, eos)
            checked, proposed = checked + 1, proposed + bool(got)
            request.output_ids.extend(rng.randrange(alphabet) for _ in range(rng.randint(1, 3)))
    assert proposed > checked // 3  # the sequences repeat enough for lookups to find something


def test_ngram_index_takes_the_first_occurrence_of_the_longest_suffix():
    index = NgramIndex(2)
    request = Request("r", [5, 1, 2, 7, 1, 2, 9, 1, 2], 8, None, 0)
    index.extend(request)
    assert index.propose(3) == [7, 1, 2]  # (1, 2) first seen at 1: what followed it there
    assert index.propose(3, eos_token_ids={1}) == [7]  # cut before the first EOS
    request.output_ids.append(8)  # (2, 8) and (8,) are new: nothing to continue
    index.extend(request)
    assert index.propose(3) == []


# ---------------------------------------------------------------------------------- verification
def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, then the bonus
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the correction after the first mismatch
    assert accept_greedy([4], [3, 1]) == [3]


def chi2_critical(df: int, z: float = 4.0) -> float:
    """Upper quantile of chi-square with ``df`` degrees of freedom at normal deviate ``z``
    (Wilson-Hilferty; z=4: p about 3e-5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_distributed(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Pearson's chi-square of ``counts`` against ``probs`` (cells of small expectation merged)."""
    n = float(counts.sum())
    expected = probs * n
    small = expected < 5
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    cells_obs = torch.cat([counts[~small].double(), counts[small & (probs > 0)].sum().double().view(1)])
    cells_exp = torch.cat([expected[~small].double(), expected[small & (probs > 0)].sum().double().view(1)])
    keep = cells_exp > 0
    stat = float(((cells_obs[keep] - cells_exp[keep]) ** 2 / cells_exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} > {chi2_critical(df):.1f} (df {df})"


def random_probs(gen: torch.Generator, rows: int, vocab: int, zeros: int = 1) -> torch.Tensor:
    p = torch.rand(rows, vocab, generator=gen, dtype=torch.float64) ** 2
    for r in range(rows):
        p[r, torch.randperm(vocab, generator=gen)[:zeros]] = 0  # some tokens impossible
    return p / p.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(point_mass):
    """Many runs of k=2 proposals drawn from q (a point mass: prompt lookup): the first emitted
    token follows p[0]; after an accepted first proposal d1, the second follows p[1] (the target's
    after d1); after two, the bonus token follows p[2]."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 2, 20000
    p = random_probs(gen, k + 1, vocab)
    q = random_probs(gen, k, vocab, zeros=2)
    first = torch.zeros(vocab, dtype=torch.long)
    second = torch.zeros(vocab, dtype=torch.long)
    bonus = torch.zeros(vocab, dtype=torch.long)
    fixed = [int(p[0].argmin()), int(p[1].argmax())]  # a point mass on a token p[0] never draws, then a likely one
    d1 = fixed[0] if point_mass else 1
    outcomes = set()
    for _ in range(n):
        if point_mass:
            draft = list(fixed)
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        out = rejection_sample(p.float(), draft, None if point_mass else q.float(), gen)
        assert 1 <= len(out) <= k + 1 and out[: len(out) - 1] == draft[: len(out) - 1]
        first[out[0]] += 1
        outcomes.add(len(out))
        if not point_mass and len(out) >= 2 and out[0] == d1 and draft[0] == d1:
            second[out[1]] += 1  # d1 was accepted: the next token is the target's after d1
        if len(out) == k + 1:
            bonus[out[-1]] += 1
    assert_distributed(first, p[0])
    if point_mass:  # d1 is impossible under p[0]: always rejected, the drawn token follows p[0] alone
        assert outcomes == {1}
    else:
        assert outcomes == {1, 2, 3}  # rejections at both positions and full acceptances happened
        assert second.sum() > 1000
        assert_distributed(second, p[1])
        assert_distributed(bonus, p[2])


def test_rejection_sampling_with_a_point_mass_accepts_at_the_target_probability():
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.2, 0.7, 0.1], [0.5, 0.25, 0.25]])
    n = 20000
    counts = torch.zeros(3, dtype=torch.long)
    accepted = 0
    for _ in range(n):
        out = rejection_sample(p, [1], None, gen)
        accepted += len(out) == 2
        counts[out[0]] += 1
    assert abs(accepted / n - 0.7) < 0.02  # accepted with p(d1)
    assert_distributed(counts, p[0])  # and yet the first token is distributed as p[0]


# ---------------------------------------------------------------------------------- adaptive k
def test_allocate_speculates_at_batch_one_and_stops_in_a_big_batch():
    assert allocate([(0.8, 0.8)], [6], overhead=20.0, num_decoding=1) == [6]
    assert allocate([(0.8, 0.8)], [6], overhead=0.0, num_decoding=1) == [0]  # a step costs its tokens only
    big = allocate([(0.6, 0.6)] * 64, [4] * 64, overhead=20.0, num_decoding=64)
    assert sum(big) == 0  # 64 decodes: an extra row costs more than what it earns
    assert sum(allocate([(0.6, 0.6)] * 8, [4] * 8, overhead=20.0, num_decoding=8)) > 0  # 8 decodes: it pays
    # Mixed acceptance: the slots go to the requests whose proposals are accepted
    ks = allocate([(0.95, 0.95), (0.1, 0.9), (0.6, 0.6)], [4, 4, 4], overhead=8.0, num_decoding=3)
    assert ks[0] >= ks[2] > ks[1] == 0
    assert allocate([(0.0, 1.0), (1.0, 1.0)], [3, 0], overhead=30.0, num_decoding=2) == [0, 0]  # rate 0, limit 0
    # A poor first proposal whose continuation is good: once it pays, the request takes many slots
    assert allocate([(0.3, 0.9)], [8], overhead=16.0, num_decoding=1) == [8]


def test_allocate_maximises_tokens_per_cost():
    """The greedy allocation is optimal: no other choice of ks earns more tokens per unit of cost."""
    import itertools

    rates, limits, overhead = [(0.9, 0.8), (0.5, 0.5), (0.4, 0.9)], [3, 3, 2], 5.0

    def tokens_per_cost(ks: tuple[int, ...]) -> float:
        emitted = 3 + sum(sum(f * c ** (j - 1) for j in range(1, k + 1)) for (f, c), k in zip(rates, ks))
        return emitted / (overhead + 3 + sum(ks))

    best = max(itertools.product(*(range(n + 1) for n in limits)), key=tokens_per_cost)
    assert tuple(allocate(rates, limits, overhead, 3)) == best


def test_acceptance_follows_the_text_and_probes_with_a_backoff():
    a = Acceptance()
    prior = (a.first, a.continued)
    assert a.probe_due  # nothing known yet: the first decode step probes
    for _ in range(30):
        a.observe(4, 0)
    assert a.first < 0.1 and abs(a.continued - prior[1]) < 1e-9  # nothing was learned about continuations
    assert a.probe_after == a.probe_max == 256 and not a.probe_due  # failed probes: the next one waits longest
    for _ in range(255):
        a.idle()
    assert not a.probe_due
    a.idle()
    assert a.probe_due
    for _ in range(30):
        a.observe(4, 1)  # the first right, the second wrong
    assert a.first > 0.95 and a.continued < 0.1 and a.probe_after == 8
    for _ in range(30):
        a.observe(4, 4)
    assert a.first > 0.95 and a.continued > 0.95 and abs(a.gain(3) - a.first * a.continued**2) < 1e-12


def test_allocate_counts_a_draft_models_rounds():
    # a round of the draft costs 5 rows: one request's slots must pay for their rounds, a batch's share them
    assert allocate([(0.3, 0.5)], [4], overhead=18.0, num_decoding=1, round_cost=5.0) == [0]
    assert allocate([(0.3, 0.5)], [4], overhead=18.0, num_decoding=1) != [0]
    assert allocate([(0.9, 0.9)], [4], overhead=18.0, num_decoding=1, round_cost=5.0) == [4]
    alone = allocate([(0.95, 0.95)], [4], overhead=18.0, num_decoding=16, round_cost=5.0)
    shared = allocate([(0.95, 0.95)] * 16, [4] * 16, overhead=18.0, num_decoding=16, round_cost=5.0)
    assert alone == [0] and min(shared) > 0
    # fewer rounds pay better than the slots' own choice: the deep slots are cut
    cut = allocate([(0.9, 0.6)] * 4, [6] * 4, overhead=18.0, num_decoding=4, round_cost=6.0)
    assert 0 < max(cut) < max(allocate([(0.9, 0.6)] * 4, [6] * 4, overhead=18.0, num_decoding=4))


def test_allocate_pays_the_switch_to_a_verify_step_only_when_it_earns_it():
    # two requests of 8 with a good acceptance: two slots earn 1.8 tokens, the switch costs 4
    few = [(0.9, 0.0)] * 2 + [(0.0, 0.0)] * 6
    assert allocate(few, [1] * 8, overhead=16.0, num_decoding=8, switch=0.0) == [1, 1] + [0] * 6
    assert allocate(few, [1] * 8, overhead=16.0, num_decoding=8, switch=4.0) == [0] * 8
    assert allocate([(0.9, 0.9)] * 16, [4] * 16, overhead=16.0, num_decoding=16, switch=3.0)[0] > 0


def test_speculative_config_validates_and_parses():
    assert SpeculativeConfig.parse("ngram:5").num_speculative_tokens == 5
    parsed = SpeculativeConfig.parse("ngram:3:4")
    assert (parsed.num_speculative_tokens, parsed.max_matching_ngram_size, parsed.method) == (3, 4, "ngram")
    model = torch.nn.Linear(1, 1)
    model.config = object()
    assert SpeculativeConfig.parse("draft:2", draft_model=model).method == "draft"
    for bad in ("ngram", "ngram:x", "beam:2", "ngram:1:2:3", "draft:3"):
        with pytest.raises(ValueError, match="speculative spec"):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(draft_model="path/to/model")


# ---------------------------------------------------------------------------------- step and blocks
def test_build_step_feeds_proposals_and_samples_their_rows():
    allocator = BlockAllocator(32)
    kv = KVBlockManager(allocator, block_size=4)
    a = Request("a", [1, 2, 3, 4, 5], 10, None, 0)  # prefilling
    b = Request("b", [6, 7], 10, None, 1, output_ids=[8])  # decoding, speculates [9, 10]
    c = Request("c", [11], 10, None, 2, output_ids=[12])  # decoding, no proposal
    for r in (b, c):
        kv.admit(r, 10)
        kv.commit(r, r.num_tokens - 1)
    kv.admit(a, 10)
    kv.reserve(b, 3)
    b.draft_ids = [9, 10]
    scheduled = [ScheduledRequest(a, 5), ScheduledRequest(b, 3), ScheduledRequest(c, 1)]
    step = build_step(scheduled, 4, torch.device("cpu"), drafts=[[], [9, 10], []])
    assert step.input_ids[0].tolist() == [1, 2, 3, 4, 5, 8, 9, 10, 12]
    assert step.position_ids[0].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 1]
    assert step.logits_indices.tolist() == [4, 5, 6, 7, 8]  # a's last, b's three, c's one
    assert not step.is_decode
    assert build_step(scheduled[2:], 4, torch.device("cpu"), drafts=[[]]).is_decode


def test_trim_gives_back_the_room_of_rejected_tokens():
    allocator = BlockAllocator(16, enable_prefix_caching=True)
    kv = KVBlockManager(allocator, block_size=2)
    request = Request("r", [1, 2, 3], 20, None, 0)
    kv.admit(request, 10)
    kv.commit(request, 3)
    request.output_ids.append(4)
    assert kv.reserve(request, 1 + 5)  # the last token and 5 proposals: positions 3..8
    assert len(request.block_ids) == 5
    request.output_ids += [5]  # one proposal accepted, then the correction
    kv.commit(request, 2)
    kv.trim(request)
    assert request.num_computed_tokens == 5 and len(request.block_ids) == 3
    assert allocator.num_used_blocks == 3 and allocator.num_cached_blocks == 2  # the two full blocks only
    allocator.check_invariants()


def test_scheduler_reserves_the_lookahead_only_when_blocks_are_free():
    allocator = BlockAllocator(4)
    kv = KVBlockManager(allocator, block_size=2)
    scheduler = Scheduler(kv, max_num_seqs=4, max_batch_tokens=16)
    request = Request("r", [1, 2, 3], 5, None, 0)
    scheduler.add(request)
    plan = scheduler.schedule()
    kv.commit(request, 3)
    request.output_ids.append(4)
    request.lookahead = 9  # more than the cache has room for: an ordinary decode, nobody preempted
    plan = scheduler.schedule()
    assert [s.num_new_tokens for s in plan.scheduled] == [1] and plan.num_lookahead_tokens == 0
    kv.commit(request, 1)
    request.output_ids.append(5)
    request.lookahead = 2
    plan = scheduler.schedule()
    assert [s.num_new_tokens for s in plan.scheduled] == [3] and plan.num_lookahead_tokens == 2


# ---------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("window", [(-1, -1), (5, 0)])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_torch_backend_attends_verification_rows_in_place(window, softcap):
    """Requests of 1 + k queries (a verify step) next to a prefill: equal to the reference."""
    gen = torch.Generator().manual_seed(3)
    h, h_kv, d, block_size = 4, 2, 16, 4
    q_lens, k_lens = [3, 1, 6, 20], [17, 9, 30, 20]
    num_blocks = sum(-(-n // block_size) for n in k_lens) + 2
    k_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(k_lens), 10), -1, dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(k_lens):
        blocks = [order.pop() for _ in range(-(-n // block_size))]
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size for i in range(n)])
        keys.append(k_cache.view(-1, h_kv, d)[slots])
        values.append(v_cache.view(-1, h_kv, d)[slots])
    q = torch.randn(sum(q_lens), h, d, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    options = AttentionOptions(softmax_scale=0.25, causal=True, window_size=window, softcap=softcap, sinks=None)
    out = torch_backend.paged_prefill_attention(
        q, k_cache, v_cache, cu_q, torch.tensor(k_lens, dtype=torch.int32), table, max(q_lens), max(k_lens),
        options=options, memo={},
    )  # fmt: skip
    expected = reference.varlen_reference(q, torch.cat(keys), torch.cat(values), cu_q, cu_k, options=options)
    torch.testing.assert_close(out, expected.to(out.dtype), atol=1e-5, rtol=1e-5)
