"""Stop strings, stopping criteria, max_time, logprobs and per-request seeds, against transformers'
own generate on the bundled demo model (real text, so stop strings occur)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig

PROMPTS = ["The for statement", "A list is", "Exceptions are raised when", "The import statement"]


def one_by_one(model, tok, **kwargs) -> list[list[int]]:
    """Each prompt alone through ``model.generate`` (no padding: the reference for the engine)."""
    outs = []
    for text in PROMPTS:
        ids = tok(text, return_tensors="pt")["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)
        outs.append(out[0, ids.shape[1] :].tolist())
    return outs


def test_stop_strings_stop_where_sdpa_stops(demo):
    tokenizer, paged, ref = demo
    kwargs = dict(max_new_tokens=40, stop_strings=[" the", "."], tokenizer=tokenizer)
    want = one_by_one(ref, tokenizer, **kwargs)
    assert any(len(w) < 40 for w in want), "no stop string fired: the test could not fail"
    assert one_by_one(paged, tokenizer, **kwargs) == want
    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64))
    config = GenerationConfig(do_sample=False, stop_strings=[" the", "."])
    outs = engine.add_all([dict(input_ids=tokenizer(t)["input_ids"], max_new_tokens=40, generation_config=config,
                                tokenizer=tokenizer) for t in PROMPTS])  # fmt: skip
    finals = engine.collect(outs)
    assert [o.output_ids for o in finals] == want
    reasons = [o.finish_reason for o in finals]
    assert "stop" in reasons, reasons
    for out in finals:
        text = tokenizer.decode(out.output_ids)
        # the stop string stays in the output, as in transformers
        assert (out.finish_reason == "stop") == (text.endswith(" the") or text.endswith(".")), (text, out)


class StopAfter(StoppingCriteria):
    """Stops a sequence once it holds ``n`` tokens past ``start``: a per-row criterion."""

    def __init__(self, start: int, n: int) -> None:
        self.start, self.n = start, n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.start >= self.n, dtype=torch.bool)


def test_custom_stopping_criteria_are_honoured(demo):
    tokenizer, paged, ref = demo
    ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    criteria = StoppingCriteriaList([StopAfter(ids.shape[1], 5)])
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, stopping_criteria=criteria)
    got = paged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, stopping_criteria=criteria)
    assert want.shape[1] == ids.shape[1] + 5 and torch.equal(got, want)


def test_max_time_is_honoured(demo):
    tokenizer, paged, _ = demo
    ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    out = paged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=200, max_time=1e-4, min_new_tokens=0)
    assert out.shape[1] - ids.shape[1] < 5  # sdpa stops after 1 token here; the engine at its first check


def test_logprobs_match_log_softmax_of_sdpa_logits(demo):
    tokenizer, paged, ref = demo
    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64))
    prompt = tokenizer(PROMPTS[1])["input_ids"]
    (out,) = engine.generate([prompt], max_new_tokens=6)  # no logprobs asked: none recorded
    assert out.logprobs is None
    rid = engine.add_request(prompt, max_new_tokens=6, logprobs=3)
    (out,) = engine.collect([rid])
    ids = torch.tensor([prompt])
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                        output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert out.output_ids == want.sequences[0, len(prompt) :].tolist() and len(out.logprobs) == 6
    for lp, logits, token in zip(out.logprobs, want.logits, out.output_ids):
        ref_lp = torch.log_softmax(logits[0].float(), dim=-1)
        assert lp.token_id == token and abs(lp.logprob - float(ref_lp[token])) < 1e-5
        values, top_ids = ref_lp.topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert max(abs(v - float(w)) for (_, v), w in zip(lp.top, values)) < 1e-5


def test_a_request_seed_makes_sampling_reproducible(demo):
    tokenizer, paged, _ = demo
    prompt = tokenizer(PROMPTS[2])["input_ids"]
    config = GenerationConfig(do_sample=True, temperature=1.5, top_k=0)

    def sample(seed: int, engine_seed: int) -> list[int]:
        engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, seed=engine_seed))
        other = engine.add_request(prompt, max_new_tokens=12, generation_config=config)  # draws from the engine's
        rid = engine.add_request(prompt, max_new_tokens=12, generation_config=config, seed=seed)
        finals = {o.request_id: o for o in engine.collect([other, rid])}
        return finals[rid].output_ids

    assert sample(7, engine_seed=1) == sample(7, engine_seed=2)
    assert sample(7, engine_seed=1) != sample(8, engine_seed=1)
