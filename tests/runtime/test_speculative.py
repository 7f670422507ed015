"""Speculative decoding in the engine, against transformers: greedy parity with sdpa's plain greedy
for prompt lookup and draft models (one that always agrees: the target's twin; one that never
does: another random model) on several architectures and block sizes, with prefix caching,
preemption, EOS, stop strings and ``max_new_tokens`` inside accepted runs; sampled runs whose token
frequencies follow the target's distribution; logprobs and scores per accepted token; refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.speculative import SpeculativeConfig
from hf_paged_attn_tools.testing import (
    compare_greedy,
    load_pair,
    ragged_prompts,
    reference_greedy,
    save_random_model,
    tiny_llama_config,
)
from hf_paged_attn_tools.tiny_configs import tiny_config

from .test_speculative_units import assert_distributed


def mixed_qwen2():
    config = tiny_config("qwen2")
    config.use_sliding_window, config.max_window_layers, config.sliding_window = True, 1, 8
    config.layer_types = ["full_attention"] + ["sliding_attention"] * (config.num_hidden_layers - 1)
    return config


ARCHS = {"llama": tiny_llama_config, "gemma2": lambda: tiny_config("gemma2"), "qwen2_mixed": mixed_qwen2}
REFERENCE = {"gemma2": "eager"}  # softcap: sdpa lacks it


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    """(name, reference model, paged model, its paged twin, a paged stranger with the same vocabulary)."""
    name = request.param
    directory = save_random_model(ARCHS[name](), tmp_path_factory.mktemp(name))
    ref, paged = load_pair(directory, reference=REFERENCE.get(name, "sdpa"))
    twin = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged").eval()
    stranger_dir = save_random_model(tiny_llama_config(num_hidden_layers=1), tmp_path_factory.mktemp("other"), seed=7)
    stranger = AutoModelForCausalLM.from_pretrained(stranger_dir, attn_implementation="paged").eval()
    return name, ref, paged, twin, stranger


def looping_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short phrase (prompt lookup finds it) behind a shared head (prefix hits)."""
    head = ragged_prompts(1, 9, 9, seed=seed)[0]
    phrases = ragged_prompts(num, 2, 5, seed=seed + 1)
    return [head + phrase * 3 for phrase in phrases]


def greedy_refs(ref, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [reference_greedy(ref, p, new) for p in prompts]


def run(engine: ContinuousBatchingEngine, prompts: list[list[int]], new: int | list[int], **kwargs) -> list:
    return engine.generate(prompts, max_new_tokens=new, **kwargs)


def assert_no_leak(engine: ContinuousBatchingEngine) -> None:
    engine.allocator.check_invariants()
    assert engine.allocator.num_used_blocks == 0, f"{engine.allocator.num_used_blocks} blocks leaked"
    assert not engine.has_unfinished()


def method_config(method: str, twin, stranger, k: int = 3, adaptive: bool = False) -> SpeculativeConfig:
    draft = {"ngram": None, "twin": twin, "stranger": stranger}[method]
    return SpeculativeConfig(num_speculative_tokens=k, draft_model=draft, adaptive=adaptive)


# ------------------------------------------------------------------------------------ greedy parity
@pytest.mark.parametrize("method", ["ngram", "twin", "stranger"])
def test_greedy_parity_with_sdpa(arch, method):
    """Two passes over prompts with a shared head on one engine (the second hits the prefix cache
    that the first pass's speculative steps filled): every token is sdpa's plain greedy."""
    name, ref, paged, twin, stranger = arch
    prompts, new = looping_prompts(5, seed=3), 24
    expected = greedy_refs(ref, prompts, new)
    config = PagedConfig(block_size=4, num_blocks=200, speculative=method_config(method, twin, stranger))
    engine = ContinuousBatchingEngine(paged, config)
    for _ in range(2):
        outs = run(engine, prompts, new)
        problems = compare_greedy(ref, prompts, expected, [o.output_ids for o in outs])
        assert not problems, "\n".join(problems)
    stats = engine.stats
    assert stats.num_cached_tokens > 0 and stats.num_draft_tokens > 0
    # Plain decoding takes 2 * new steps (per pass: the prefill, which emits the first token, then
    # one step per token); a speculative step emits at least one token per request, so never more.
    assert stats.num_steps <= 2 * new
    if method == "ngram":  # a random model's loops: some lookups hit
        assert stats.num_accepted_tokens > 10
    elif method == "twin":  # the same model: every proposal but numerical near-ties
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
        # k = 3 proposals all accepted emit k + 1 tokens a step: per pass the prefill, then
        # ceil((new - 1) / (k + 1)) steps; each rejected proposal costs at most one step more
        k = 3
        rejected = stats.num_draft_tokens - stats.num_accepted_tokens
        assert stats.num_steps <= 2 * (1 + -(-(new - 1) // (k + 1))) + rejected
    else:
        assert stats.acceptance_rate < 0.3
    assert_no_leak(engine)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("method", ["ngram", "twin"])
def test_greedy_parity_under_preemption(llama_pair, llama_dir, block_size, method):
    """A cache barely larger than one request: speculating requests are preempted mid-run (their
    proposals dropped, their blocks freed) and recomputed; the tokens stay greedy's."""
    ref, paged = llama_pair
    twin = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged").eval()
    prompts, new = looping_prompts(6, seed=5), 20
    expected = greedy_refs(ref, prompts, new)
    longest = max(map(len, prompts)) + new
    config = PagedConfig(block_size=block_size, num_blocks=-(-longest // block_size) + 1, max_batch_tokens=16,
                         speculative=method_config(method, twin, None, k=4))  # fmt: skip
    engine = ContinuousBatchingEngine(paged, config)
    outs = run(engine, prompts, new)
    assert not compare_greedy(ref, prompts, expected, [o.output_ids for o in outs])
    assert engine.stats.num_preemptions > 0 and engine.stats.num_accepted_tokens > 0
    assert_no_leak(engine)


def test_eos_and_max_new_tokens_inside_accepted_runs(llama_pair, llama_dir):
    """A draft that always agrees proposes whole runs; EOS and the length limit that fall inside one
    end the request at exactly the token plain greedy ends it."""
    ref, paged = llama_pair
    twin = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged").eval()
    prompts = ragged_prompts(4, 4, 12, seed=9)
    free = greedy_refs(ref, prompts, 30)
    eos = free[0][9]  # a token the first row emits after 9 others: other rows meet it elsewhere
    limits = [7, 11, 30, 13]
    config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = []
    for p, n in zip(prompts, limits):
        out = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
        expected.append(out[0, len(p) :].tolist())
    k = 4
    engine = ContinuousBatchingEngine(
        paged, PagedConfig(block_size=4, num_blocks=100, speculative=SpeculativeConfig(k, twin, adaptive=False)),
        generation_config=config,
    )  # fmt: skip
    ids = [engine.add_request(p, max_new_tokens=n) for p, n in zip(prompts, limits)]
    finals, last_new = {}, {}
    for out in engine.stream():
        last_new[out.request_id] = out.new_ids
        if out.finished:
            finals[out.request_id] = out
    for rid, want in zip(ids, expected):
        assert finals[rid].output_ids == want
        assert finals[rid].finish_reason == ("eos" if want[-1] == eos and eos not in want[:-1] else "length")
    assert any(finals[rid].finish_reason == "eos" for rid in ids)
    # some request ended part-way through a run the draft had proposed in full
    assert any(0 < len(last_new[rid]) < k + 1 for rid in ids)
    assert engine.stats.num_accepted_tokens >= 0.9 * engine.stats.num_draft_tokens
    assert_no_leak(engine)


def test_stop_strings_inside_accepted_runs_end_where_sdpa_ends(demo):
    tokenizer, paged, ref = demo
    twin = AutoModelForCausalLM.from_pretrained(paged.name_or_path, attn_implementation="paged").eval()
    texts = ["The for statement", "A list is", "The import statement"]
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        kwargs = dict(max_new_tokens=40, do_sample=False, stop_strings=["statement", "list"], tokenizer=tokenizer)
        expected = ref.generate(ids, **kwargs)
        got = paged.generate(ids, assistant_model=twin, num_assistant_tokens=5, **kwargs)
        assert torch.equal(got, expected), text
        got = paged.generate(ids, prompt_lookup_num_tokens=5, **kwargs)
        assert torch.equal(got, expected), text


def test_speculating_and_plain_requests_share_steps(llama_pair):
    """Requests with their own prompt lookup (generation config), with the engine's, opted out
    (``prompt_lookup_num_tokens=0``) and one whose processor reads the ids (it decodes without
    speculation) share steps: all equal sdpa."""
    ref, paged = llama_pair
    prompts, new = looping_prompts(4, seed=11), 16
    spec = SpeculativeConfig(num_speculative_tokens=2, adaptive=False)
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=100, speculative=spec))
    lookup = GenerationConfig(do_sample=False, prompt_lookup_num_tokens=4, max_matching_ngram_size=3)
    off = GenerationConfig(do_sample=False, prompt_lookup_num_tokens=0)
    penalty = GenerationConfig(do_sample=False, repetition_penalty=1.5)
    configs = [lookup, None, off, penalty]
    ids = [engine.add_request(p, max_new_tokens=new, generation_config=c) for p, c in zip(prompts, configs)]
    finals = {o.request_id: o for o in engine.stream() if o.finished}
    for rid, p, c in zip(ids, prompts, configs):
        options = dict(repetition_penalty=1.5) if c is penalty else {}
        want = ref.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, **options)[0, len(p) :].tolist()
        assert not compare_greedy(ref, [p], [want], [finals[rid].output_ids]), (rid, c)
    assert engine.stats.num_draft_tokens > 0
    assert engine.intake.live == {} and engine.allocator.num_used_blocks == 0


def test_logprobs_and_scores_per_accepted_token(llama_pair, llama_dir):
    """What a request records per token is the same with and without speculation."""
    ref, paged = llama_pair
    twin = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged").eval()
    prompts = looping_prompts(2, seed=13)
    config = GenerationConfig(do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    results = []
    for spec in (None, SpeculativeConfig(3, twin, adaptive=False)):
        engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64, speculative=spec))
        ids = [engine.add_request(p, max_new_tokens=12, generation_config=config, logprobs=2) for p in prompts]
        finals = {o.request_id: o for o in engine.stream() if o.finished}
        results.append([finals[i] for i in ids])
        if spec is not None:
            assert engine.stats.num_accepted_tokens > 0
    for plain, fast in zip(*results):
        assert fast.output_ids == plain.output_ids
        assert len(fast.scores) == len(fast.logits) == len(fast.logprobs) == len(fast.output_ids)
        for a, b in zip(plain.logprobs, fast.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        torch.testing.assert_close(torch.stack(fast.scores), torch.stack(plain.scores), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.stack(fast.logits), torch.stack(plain.logits), atol=1e-4, rtol=1e-4)


def test_a_draft_that_never_agrees_backs_off(arch):
    """Adaptive k: a stranger's proposals are rejected, so it soon proposes only now and then (its
    costs set to nothing, as a tiny draft of a large model's, so that it starts at all)."""
    name, ref, paged, twin, stranger = arch
    if name != "llama":
        pytest.skip("one architecture is enough")
    prompts, new = looping_prompts(2, seed=17), 40
    config = PagedConfig(block_size=4, num_blocks=100, speculative=SpeculativeConfig(4, stranger))
    engine = ContinuousBatchingEngine(paged, config)
    engine.speculator.round_cost = engine.speculator.slot_cost = 0.0
    outs = run(engine, prompts, new)
    assert not compare_greedy(ref, prompts, greedy_refs(ref, prompts, new), [o.output_ids for o in outs])
    stats = engine.stats
    assert 0 < stats.num_draft_tokens < len(prompts) * new, "proposals went on at full rate"
    assert stats.acceptance_rate < 0.3


# ------------------------------------------------------------------------------------ sampling
@pytest.fixture(scope="module")
def vocab16(tmp_path_factory):
    """(reference, paged, a paged stranger): 16-token vocabularies, so frequencies pin down quickly."""
    config = tiny_llama_config(vocab_size=16, initializer_range=0.05)
    ref, paged = load_pair(save_random_model(config, tmp_path_factory.mktemp("v16")))
    other = save_random_model(tiny_llama_config(vocab_size=16, num_hidden_layers=1), tmp_path_factory.mktemp("o16"), 3)
    return ref, paged, AutoModelForCausalLM.from_pretrained(other, attn_implementation="paged").eval()


def target_marginals(
    ref, prompt: list[int], temperature: float, steps: int, warpers: list | None = None
) -> list[torch.Tensor]:
    """The exact distribution of each of the first ``steps`` sampled tokens: [vocab] each; the
    reference's logits go through temperature, then transformers' own ``warpers`` (top-k, ...)."""
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), *(warpers or [])])
    marginals, prefixes, weights = [], [prompt], torch.ones(1, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            logits = ref(torch.tensor(prefixes)).logits[:, -1].double()
        probs = torch.softmax(processors(torch.tensor(prefixes), logits), dim=-1)  # [prefixes, vocab]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(dim=0))
        vocab = probs.shape[-1]
        prefixes = [p + [t] for p in prefixes for t in range(vocab)]
        weights = joint.flatten()
    return marginals


def target_joint(ref, prompt: list[int], temperature: float, steps: int, warpers: list) -> torch.Tensor:
    """The exact probability of every sequence of the first ``steps`` sampled tokens,
    [vocab ** steps] (index: the tokens as digits in base vocab), the logits put through
    temperature and transformers' ``warpers``; prefixes of probability 0 are not run."""
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), *warpers])
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = [prompt]
    for _ in range(steps):
        live = joint > 0
        rows = [p for p, keep in zip(prefixes, live.tolist()) if keep]
        with torch.no_grad():
            logits = ref(torch.tensor(rows)).logits[:, -1].double()
        probs = torch.softmax(processors(torch.tensor(rows), logits), dim=-1)  # [live prefixes, vocab]
        vocab = probs.shape[-1]
        step = torch.zeros(len(prefixes), vocab, dtype=torch.float64)
        step[live] = probs
        joint = (joint[:, None] * step).flatten()
        prefixes = [p + [t] for p in prefixes for t in range(vocab)]
    return joint


@pytest.mark.parametrize("method", ["ngram", "stranger"])
def test_sampled_tokens_follow_the_target_distribution(vocab16, method):
    """Many sampled requests under speculation: the frequencies of their first three tokens match
    the exact marginals of the target's distribution (chi-square), with proposals both accepted and
    rejected along the way (prompt lookup: point masses; the stranger: its own q)."""
    ref, paged, stranger = vocab16
    # every token of the vocabulary occurs in the prompt: prompt lookup always finds a continuation
    prompt, temperature, n, steps = [3, 9, 0, 12, 5, 1, 14, 7, 2, 11, 4, 15, 8, 6, 13, 10, 3, 9], 0.8, 2000, 4
    spec = SpeculativeConfig(3, stranger if method == "stranger" else None, adaptive=False)
    engine = ContinuousBatchingEngine(
        paged, PagedConfig(block_size=4, num_blocks=1200, max_num_seqs=256, seed=0, speculative=spec)
    )
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    outs = engine.generate([prompt] * n, max_new_tokens=steps, generation_config=config)
    stats = engine.stats
    assert stats.num_accepted_tokens > 300 and stats.num_draft_tokens - stats.num_accepted_tokens > 300
    for t, expected in enumerate(target_marginals(ref, prompt, temperature, steps)):
        counts = torch.bincount(torch.tensor([o.output_ids[t] for o in outs]), minlength=16)
        assert_distributed(counts, expected.float())
    # The second token after each of the most frequent first ones: prompt lookup proposes one token
    # there every time, so a wrong acceptance rule would pile up on it
    firsts = torch.bincount(torch.tensor([o.output_ids[0] for o in outs]), minlength=16)
    for first in firsts.topk(3).indices.tolist():
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + [first]])).logits[0, -1].double()
        seconds = [o.output_ids[1] for o in outs if o.output_ids[0] == first]
        assert_distributed(torch.bincount(torch.tensor(seconds), minlength=16), torch.softmax(logits / temperature, -1))


TRUNCATIONS = {  # generation options -> transformers' warper of the same truncation
    "top_k": (dict(top_k=3, top_p=1.0), TopKLogitsWarper(3)),
    "top_p": (dict(top_k=0, top_p=0.4), TopPLogitsWarper(0.4)),
    "min_p": (dict(top_k=0, top_p=1.0, min_p=0.5), MinPLogitsWarper(0.5)),
}


@pytest.fixture(scope="module")
def near_draft(vocab16):
    """The vocab16 target with noise on its output layer as a paged draft: its truncated supports
    overlap the target's (proposals are accepted) but its probabilities differ (and are rejected)."""
    draft = AutoModelForCausalLM.from_pretrained(vocab16[1].name_or_path, attn_implementation="paged").eval()
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * w.std())
    return draft


@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
def test_truncated_sampling_with_a_draft_follows_the_truncated_target(vocab16, near_draft, truncation):
    """Top-k, top-p and min-p under a draft model: the frequencies of the sequences of the first
    three tokens match their exact probabilities under the target's logits put through
    transformers' own warpers (chi-square; a sequence the warpers exclude must never occur). The draft
    proposes from its own truncated distribution, which differs from the target's support, so
    proposals are accepted and rejected; were the q handed to the verifier not the distribution the
    draft drew from (e.g. one truncated and the other not), accepted drafts would be over- or
    under-weighted and the counts would leave the target's."""
    ref, paged, _ = vocab16
    prompt, temperature, n, steps = [3, 9, 0, 12, 5, 1, 14, 7, 2, 11, 4, 15, 8, 6, 13, 10, 3, 9], 0.8, 800, 3
    options, warper = TRUNCATIONS[truncation]
    spec = SpeculativeConfig(2, near_draft, adaptive=False)  # the first token is the prefill's, then d1, d2
    engine = ContinuousBatchingEngine(
        paged, PagedConfig(block_size=4, num_blocks=1200, max_num_seqs=256, seed=0, speculative=spec)
    )
    config = GenerationConfig(do_sample=True, temperature=temperature, **options)
    outs = engine.generate([prompt] * n, max_new_tokens=steps, generation_config=config)
    stats = engine.stats
    assert stats.num_accepted_tokens > 100 and stats.num_draft_tokens - stats.num_accepted_tokens > 100
    joint = target_joint(ref, prompt, temperature, steps, [warper])  # [16 ** steps]
    assert int((joint > 0).sum()) < 16**steps // 4  # the warper truncates
    sequences = torch.tensor([o.output_ids[0] * 16**2 + o.output_ids[1] * 16 + o.output_ids[2] for o in outs])
    assert_distributed(torch.bincount(sequences, minlength=16**steps), joint)


# ------------------------------------------------------------------------------------ generate
def test_generate_prompt_lookup_equals_sdpa_greedy(llama_pair):
    """``prompt_lookup_num_tokens`` / ``max_matching_ngram_size`` on a left-padded batch (transformers
    runs prompt lookup at batch size 1 only): sdpa's plain greedy tokens."""
    from hf_paged_attn_tools.testing import left_padded

    ref, paged = llama_pair
    prompts = looping_prompts(4, seed=19)
    ids, mask = left_padded(prompts)
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for options in (dict(prompt_lookup_num_tokens=3), dict(prompt_lookup_num_tokens=6, max_matching_ngram_size=4)):
        got = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, **options)
        rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        width = ids.shape[1]
        assert not compare_greedy(ref, rows, expected[:, width:].tolist(), got[:, width:].tolist()), options
    single = paged.generate(torch.tensor([prompts[0]]), max_new_tokens=20, prompt_lookup_num_tokens=3)
    looked_up = ref.generate(torch.tensor([prompts[0]]), max_new_tokens=20, prompt_lookup_num_tokens=3)
    assert torch.equal(single, looked_up)  # and transformers' own prompt lookup at batch size 1


def test_generate_with_assistant_model_equals_sdpa(llama_pair, llama_dir):
    """``assistant_model`` (loaded with sdpa, as transformers takes it) on a batch, with
    ``num_assistant_tokens``: greedy's tokens; the assistant keeps its attention afterwards."""
    from hf_paged_attn_tools.testing import left_padded

    ref, paged = llama_pair
    assistant = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="sdpa").eval()
    ids, mask = left_padded(looping_prompts(3, seed=23))
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    got = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                         assistant_model=assistant, num_assistant_tokens=3)  # fmt: skip
    assert torch.equal(got, expected)
    assert assistant.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------------------------ refusals
def test_what_cannot_speculate_is_refused_by_name(llama_pair, tmp_path):
    ref, paged = llama_pair
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    with pytest.raises(NotImplementedError, match="prompt_lookup_num_tokens=3 with num_beams=2"):
        paged.generate(ids, max_new_tokens=4, num_beams=2, prompt_lookup_num_tokens=3)
    with pytest.raises(NotImplementedError, match="assistant_model with num_beams=2"):
        paged.generate(ids, max_new_tokens=4, num_beams=2, assistant_model=ref)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be an int"):
        paged.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=-1)
    other_vocab = save_random_model(tiny_llama_config(vocab_size=300), tmp_path / "v300")
    draft = AutoModelForCausalLM.from_pretrained(other_vocab, attn_implementation="paged")
    with pytest.raises(ValueError, match="vocabulary has 300 tokens, the target's 256"):
        ContinuousBatchingEngine(paged, PagedConfig(num_blocks=16, speculative=SpeculativeConfig(draft_model=draft)))
    with pytest.raises(ValueError, match="draft model's attention implementation is 'sdpa'"):
        ContinuousBatchingEngine(paged, PagedConfig(num_blocks=16, speculative=SpeculativeConfig(draft_model=ref)))
    sliding = save_random_model(tiny_config("mistral"), tmp_path / "mistral")
    target = AutoModelForCausalLM.from_pretrained(sliding, attn_implementation="paged")
    twin = AutoModelForCausalLM.from_pretrained(sliding, attn_implementation="paged")
    with pytest.raises(ValueError, match="needs a target with full-attention layers"):
        ContinuousBatchingEngine(target, PagedConfig(num_blocks=16, speculative=SpeculativeConfig(draft_model=twin)))
    with pytest.raises(ValueError, match="PagedConfig.speculative"):
        PagedConfig(speculative="ngram:4")
