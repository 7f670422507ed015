"""Structured outputs through the engine: constrained greedy is the argmax of transformers' (sdpa)
logits masked by llguidance's allowed set at every position; every output of sampled requests
(temperature 1) on the bundled model parses and validates; constrained and free requests share a
batch; preemption in the middle of a constrained request; ``n > 1``; ``model.generate(structured=...)``."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.runtime.generation import mask_prefill

SAMPLED = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
SCHEMAS = {
    "enum_and_bounds": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 1, "maximum": 9},
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
        },
        "required": ["color", "size", "name"],
        "additionalProperties": False,
    },
    "nested_array_ref": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
                            "required": ["x"], "additionalProperties": False}},  # fmt: skip
        "type": "object",
        "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3}},
        "required": ["points"],
        "additionalProperties": False,
    },
    "any_of_const_pattern": {
        "type": "object",
        "properties": {
            "kind": {"const": "v1"},
            "value": {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[a-z]{1,4}$"}]},
        },
        "required": ["kind", "value"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def demo_engine_parts():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged").eval()
    return tokenizer, model


def prompt(tokenizer, text: str = "The answer, as JSON:") -> list[int]:
    return tokenizer(text)["input_ids"]


def allowed_tokens(matcher: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens llguidance allows next, unpacked from its bitmask (bit j of word i: token 32i+j)."""
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bits.flatten()[:vocab].bool()


@pytest.mark.parametrize("name", ["enum_and_bounds", "nested_array_ref"])
def test_constrained_greedy_is_the_argmax_of_masked_sdpa_logits(demo_engine_parts, name, monkeypatch):
    """At each position of a constrained greedy output, its token is the argmax of sdpa's logits over
    the tokens llguidance's own matcher (built here, not through the engine's compiler) allows after
    the tokens before it, up to a 1e-4 near-tie; the output ends where the grammar does. Every mask but the
    first token's was filled ahead, between steps (``mask_prefill.py``)."""
    tokenizer, model = demo_engine_parts
    ref = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa").eval()
    ids, schema = prompt(tokenizer), SCHEMAS[name]
    filled_now: list[int] = []  # rows the sampler filled itself, not ahead
    fill_now = mask_prefill.structured_mask_rows
    monkeypatch.setattr(mask_prefill, "structured_mask_rows",
                        lambda logits, ms, rows: (filled_now.append(len(rows)), fill_now(logits, ms, rows)))
    engine = ContinuousBatchingEngine(model, PagedConfig())
    rid = engine.add_request(ids, max_new_tokens=80, tokenizer=tokenizer, structured={"json": schema})
    (out,) = engine.collect([rid])
    assert out.finish_reason in ("stop", "eos"), out.finish_reason
    assert filled_now == [1] and len(out.output_ids) > 5  # the first token's mask; the others' filled ahead
    vocab = model.config.vocab_size
    # the engine's JSON settings (structured.GrammarCompiler): compact separators, \uXXXX escapes
    options = {"json_allow_general_unicode_escapes": True, "whitespace_flexible": False,
               "item_separator": ", ", "key_separator": ": "}  # fmt: skip
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    with torch.no_grad():
        logits = ref(torch.tensor([ids + out.output_ids])).logits[0, len(ids) - 1 :].float()  # [new + 1, vocab]
    num_choices = 0  # positions where the grammar left more than one token: the argmax decided
    for i, token in enumerate(out.output_ids):
        allowed = allowed_tokens(matcher, vocab)
        num_choices += int(allowed.sum() > 1)
        masked = logits[i].masked_fill(~allowed, -torch.inf)
        assert allowed[token], f"token {i} ({token}) is not allowed by the grammar"
        if token != int(masked.argmax()):
            assert float(masked.max() - masked[token]) <= 1e-4, (i, token, int(masked.argmax()))
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_stopped() or matcher.is_accepting()
    assert num_choices >= 5, num_choices
    jsonschema.validate(json.loads(tokenizer.decode(out.output_ids, skip_special_tokens=True)), schema)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_outputs_validate_against_their_schema(demo_engine_parts, name):
    tokenizer, model = demo_engine_parts
    engine = ContinuousBatchingEngine(model, PagedConfig(seed=7))
    schema = SCHEMAS[name]
    ids = engine.add_all([dict(input_ids=prompt(tokenizer), max_new_tokens=160, generation_config=SAMPLED,
                               tokenizer=tokenizer, structured={"json": schema}) for _ in range(6)])  # fmt: skip
    for out in engine.collect(ids):
        text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
        assert out.finish_reason in ("stop", "eos"), (out.finish_reason, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_free_requests_share_a_batch(demo_engine_parts):
    tokenizer, model = demo_engine_parts
    engine = ContinuousBatchingEngine(model, PagedConfig(seed=3))
    free_alone = ContinuousBatchingEngine(model, PagedConfig()).generate([prompt(tokenizer, "A list is")], 12)[0]
    requests = [
        dict(structured={"regex": r"[0-9]{3}-[a-z]{2}"}),
        dict(structured={"choice": ["yes", "no", "maybe later"]}),
        dict(structured={"json_object": True}, max_new_tokens=120),
        dict(input_ids=prompt(tokenizer, "A list is"), max_new_tokens=12, generation_config=None),  # free, greedy
    ]
    ids = engine.add_all([{"input_ids": prompt(tokenizer), "max_new_tokens": 40, "generation_config": SAMPLED,
                           "tokenizer": tokenizer, **r} for r in requests])  # fmt: skip
    regex, choice, obj, free = engine.collect(ids)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", tokenizer.decode(regex.output_ids, skip_special_tokens=True))
    assert tokenizer.decode(choice.output_ids, skip_special_tokens=True) in ("yes", "no", "maybe later")
    # any JSON object may be long: complete when it stopped, else cut by max_new_tokens (never an error)
    assert obj.finish_reason in ("stop", "eos", "length")
    if obj.finish_reason != "length":
        assert isinstance(json.loads(tokenizer.decode(obj.output_ids, skip_special_tokens=True)), dict)
    else:
        assert tokenizer.decode(obj.output_ids, skip_special_tokens=True).startswith("{")
    assert free.output_ids == free_alone.output_ids  # the free request is untouched by its neighbours' masks


def test_preemption_in_the_middle_of_a_constrained_request(demo_engine_parts):
    """A cache so small that requests are preempted and recomputed mid-output: the grammar state
    follows the tokens, so every output still validates."""
    tokenizer, model = demo_engine_parts
    schema = SCHEMAS["enum_and_bounds"]
    engine = ContinuousBatchingEngine(model, PagedConfig(block_size=4, num_blocks=24, max_batch_tokens=16, seed=1))
    ids = engine.add_all([dict(input_ids=prompt(tokenizer), max_new_tokens=60, generation_config=SAMPLED,
                               tokenizer=tokenizer, structured={"json": schema}) for _ in range(5)])  # fmt: skip
    outs = engine.collect(ids)
    assert engine.stats.num_preemptions > 0, "the cache did not force a preemption"
    for out in outs:
        text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
    assert engine.allocator.num_used_blocks == 0


def test_each_of_n_sequences_has_its_own_grammar_state(demo_engine_parts):
    tokenizer, model = demo_engine_parts
    engine = ContinuousBatchingEngine(model, PagedConfig(seed=11))
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, num_return_sequences=4)
    rid = engine.add_request(prompt(tokenizer), max_new_tokens=120, generation_config=config, tokenizer=tokenizer,
                             structured={"json": SCHEMAS["any_of_const_pattern"]})  # fmt: skip
    outs = engine.collect([rid])
    assert len(outs) == 4
    for out in outs:
        jsonschema.validate(json.loads(tokenizer.decode(out.output_ids, skip_special_tokens=True)),
                            SCHEMAS["any_of_const_pattern"])  # fmt: skip


def test_model_generate_takes_structured(demo_engine_parts):
    tokenizer, model = demo_engine_parts
    batch = tokenizer(["The answer:", "A list is"], padding=True, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=30, do_sample=True, tokenizer=tokenizer,
                         structured={"choice": ["alpha", "beta"]})  # fmt: skip
    for row in out[:, batch["input_ids"].shape[1] :]:
        assert tokenizer.decode(row, skip_special_tokens=True) in ("alpha", "beta")


def test_bad_requests_are_refused_by_name(demo_engine_parts):
    tokenizer, model = demo_engine_parts
    engine = ContinuousBatchingEngine(model, PagedConfig())
    ids = prompt(tokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request(ids, max_new_tokens=4, structured={"regex": "a+"})
    with pytest.raises(ValueError, match="uniqueItems"):
        engine.add_request(ids, max_new_tokens=4, tokenizer=tokenizer,
                           structured={"json": {"type": "array", "uniqueItems": True}})  # fmt: skip
    with pytest.raises(ValueError, match="structured takes"):
        engine.add_request(ids, max_new_tokens=4, tokenizer=tokenizer, structured={"schema": {}})
    with pytest.raises(NotImplementedError, match="beam search"):
        engine.add_request(ids, max_new_tokens=4, tokenizer=tokenizer, structured={"regex": "a+"},
                           generation_config=GenerationConfig(num_beams=2))  # fmt: skip
    assert not engine.has_unfinished()


def test_a_greedy_row_read_beyond_its_argmax_is_masked(demo_engine_parts):
    """A greedy constrained request whose stopping criterion reads its row sees it masked at every step, and
    its tokens are those of the same request without the criterion."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Seen(StoppingCriteria):
        def __init__(self) -> None:
            self.rows: list[torch.Tensor] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
            self.rows.append(scores.clone())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    tokenizer, model = demo_engine_parts
    engine = ContinuousBatchingEngine(model, PagedConfig())
    seen, schema = Seen(), {"json": SCHEMAS["enum_and_bounds"]}
    watched = engine.add_request(prompt(tokenizer), max_new_tokens=30, tokenizer=tokenizer, structured=schema,
                                 stopping_criteria=StoppingCriteriaList([seen]))  # fmt: skip
    plain = engine.add_request(prompt(tokenizer), max_new_tokens=30, tokenizer=tokenizer, structured=schema)
    first, second = engine.collect([watched, plain])
    assert first.output_ids == second.output_ids and len(seen.rows) == len(first.output_ids) > 5
    assert all(torch.isinf(row).any() for row in seen.rows)  # a JSON grammar forbids tokens at every step
