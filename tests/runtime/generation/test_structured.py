"""Grammar-constrained decoding (``runtime/generation/structured.py``) on the demo model's tokenizer.

Random logits at temperature 1 go through the mask, a token is drawn and accepted, until the
matcher terminates: every output must then parse and validate (``jsonschema``), fullmatch its regex,
be one of its choices, or parse by its grammar. Around that: EOS only at a valid end, the batched
fill against per-row fills, the mask application against a plain loop, rollback / replay / clone
against the original masks, the compile cache, and the errors."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.kernels import cpu_bitmask
from hf_paged_attn.runtime.generation.structured import (
    GrammarCompiler,
    Matcher,
    StructuredSpec,
    apply_bitmask,
    apply_bitmask_numpy,
    apply_bitmask_torch,
)

VOCAB = 4096
EOS = 1
MAX_STEPS = 300

SCHEMAS = {
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "n": {"enum": [1, 2.5, None, True]}},
             "required": ["color", "n"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"v": {"const": "fixed"}, "w": {"const": {"k": [1, 2]}}},
              "required": ["v", "w"], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                                 "score": {"type": "number", "minimum": -1, "maximum": 1},
                                                 "name": {"type": "string", "minLength": 2, "maxLength": 6}},
                "required": ["age", "score", "name"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                  "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                           "minItems": 1, "maxItems": 3}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
        "required": ["user", "flags"], "additionalProperties": False},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 50},
                                                                 "y": {"type": "integer", "minimum": -50}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                               {"type": "null"}, {"enum": ["x", "y"]}]}},
              "required": ["v"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                 "id": {"type": "string", "format": "uuid"}},
                "required": ["code", "id"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 5}, "minItems": 1,
              "maxItems": 4},
}
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog)s?", r"[a-z]{1,5}@[a-z]{1,5}\.(com|org)", r"(?i)yes|no",
           r"(0|[1-9][0-9]{0,2})(\.[0-9]{1,2})?"]
CHOICES = ["yes", "no", "maybe", 'say "hi"', "é✓", "a", "ab"]
LARK = 'start: expr\nexpr: term (("+" | "*") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,2}/\n'
GBNF = 'root ::= expr\nexpr ::= term (("+" | "*") term)*\nterm ::= [0-9] [0-9]? | "(" expr ")"\n'


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:  # noqa: ANN001
    return GrammarCompiler(tok, VOCAB)


def allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    """The token ids whose bit is set, by a plain loop over the bits."""
    words = bitmask[row].tolist()
    return {32 * w + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1}


def sample(compiler: GrammarCompiler, specs: list[StructuredSpec], seed: int) -> list[list[int]]:
    """One constrained row per spec, all masked together each step (random logits, temperature 1)."""
    gen = torch.Generator().manual_seed(seed)
    matchers = [compiler.matcher(spec) for spec in specs]
    outputs: list[list[int]] = [[] for _ in specs]
    live = list(range(len(specs)))
    for _ in range(MAX_STEPS):
        if not live:
            return outputs
        logits = torch.randn(len(specs), VOCAB, generator=gen)  # every row, constrained or not
        compiler.mask_logits(logits, [matchers[i] for i in live], rows=live)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten().tolist()
        for i in list(live):
            m, token = matchers[i], tokens[i]
            assert (token == EOS) <= m.is_accepting(), "EOS drawn where the output is not complete"
            assert m.accept(token), f"token {token} drawn through the mask was refused"
            outputs[i].append(token)
            if m.is_terminated():
                live.remove(i)
    raise AssertionError(f"rows {live} did not end in {MAX_STEPS} steps")


def text_of(tok, tokens: list[int]) -> str:  # noqa: ANN001
    return tok.decode([t for t in tokens if t != EOS])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schemas_sampled_through_the_mask_validate(compiler, tok, seed: int) -> None:  # noqa: ANN001
    names = list(SCHEMAS)
    outputs = sample(compiler, [StructuredSpec(json=SCHEMAS[n]) for n in names], seed)
    for name, tokens in zip(names, outputs):
        jsonschema.validate(json.loads(text_of(tok, tokens)), SCHEMAS[name])


@pytest.mark.parametrize("seed", [0, 1])
def test_regex_choice_and_grammar_outputs_match(compiler, tok, seed: int) -> None:  # noqa: ANN001
    specs = [StructuredSpec(regex=r) for r in REGEXES] + [StructuredSpec(choice=CHOICES)] * 3
    specs += [StructuredSpec(grammar=LARK), StructuredSpec(grammar=GBNF)]
    outputs = [text_of(tok, t) for t in sample(compiler, specs, seed)]
    for regex, text in zip(REGEXES, outputs):
        assert re.fullmatch(regex, text), (regex, text)
    for text in outputs[len(REGEXES): len(REGEXES) + 3]:
        assert text in CHOICES
    for text in outputs[-2:]:
        assert parse_arithmetic(text), text


def parse_arithmetic(text: str) -> bool:
    """Recursive descent over ``expr: term (("+" | "*") term)*``, ``term: [0-9]{1,2} | "(" expr ")"``."""
    pos = 0

    def term() -> bool:
        nonlocal pos
        if text[pos: pos + 1] == "(":
            pos += 1
            if not expr() or text[pos: pos + 1] != ")":
                return False
            pos += 1
            return True
        digits = re.match(r"[0-9]{1,2}", text[pos:])
        pos += digits.end() if digits else 0
        return digits is not None

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while text[pos: pos + 1] in ("+", "*") and pos < len(text):
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(max_size=6), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8), max_size=4))
def test_json_object_takes_every_object(tok, compiler, value: dict) -> None:  # noqa: ANN001
    """Any object, as ``json.dumps`` writes it, is accepted whole (then EOS ends it); nothing else is."""
    m = compiler.matcher(StructuredSpec(json_object=True))
    tokens = tok.encode(json.dumps(value), add_special_tokens=False)
    assert m.accept_tokens(tokens) == len(tokens)
    assert m.is_accepting()
    assert m.accept(EOS) and m.is_terminated()


def test_json_object_refuses_other_values(tok, compiler) -> None:  # noqa: ANN001
    for text in ("[1]", '"s"', "3", "{'a': 1}", '{"a" 1}'):
        m = compiler.matcher(StructuredSpec(json_object=True))
        tokens = tok.encode(text, add_special_tokens=False)
        assert m.accept_tokens(tokens) < len(tokens), text


def advanced(compiler: GrammarCompiler, spec: StructuredSpec, steps: int, seed: int) -> tuple[Matcher, list[int]]:
    """A matcher moved ``steps`` random tokens (fewer if it terminates first) into ``spec``."""
    gen = torch.Generator().manual_seed(seed)
    m, tokens = compiler.matcher(spec), []
    for _ in range(steps):
        logits = torch.randn(1, VOCAB, generator=gen)
        compiler.mask_logits(logits, [m])
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if token == EOS:
            break
        assert m.accept(token)
        tokens.append(token)
        if m.is_terminated():
            break
    return m, tokens


def test_batched_fill_equals_per_row_fills_and_apply_equals_a_loop(compiler) -> None:  # noqa: ANN001
    specs = [StructuredSpec(json=s) for s in SCHEMAS.values()] + [StructuredSpec(regex=r) for r in REGEXES]
    matchers = [advanced(compiler, spec, steps=i % 7, seed=i)[0] for i, spec in enumerate(specs)]
    batch = compiler.allocate_bitmask(len(matchers))
    compiler.fill_bitmasks(matchers, batch)
    rows = compiler.allocate_bitmask(len(matchers))
    for i, m in enumerate(matchers):
        m.fill_bitmask(rows, i)
    assert torch.equal(batch, rows)
    # the application, on rows 1, 3, ... of a bigger tensor; the other rows stay as they were
    logits = torch.randn(2 * len(matchers), VOCAB)
    expected = logits.clone()
    for i in range(len(matchers)):
        keep = allowed(batch, i)
        expected[2 * i + 1, [t for t in range(VOCAB) if t not in keep]] = float("-inf")
    compiler.mask_logits(logits, matchers, rows=[2 * i + 1 for i in range(len(matchers))])
    assert torch.equal(logits, expected)
    every = torch.randn(len(matchers), VOCAB)
    by_rows = every.clone()
    apply_bitmask(every, batch)
    apply_bitmask(by_rows, batch, list(range(len(matchers))))
    assert torch.equal(every, by_rows)


@pytest.mark.parametrize("name", ["bounded", "nested", "pattern"])
def test_rollback_replay_and_clone_give_the_original_masks(compiler, name: str) -> None:  # noqa: ANN001
    spec = StructuredSpec(json=SCHEMAS[name])
    gen = torch.Generator().manual_seed(7)
    m, masks, tokens = compiler.matcher(spec), [], []
    for _ in range(12):
        mask = compiler.allocate_bitmask(1)
        m.fill_bitmask(mask)
        masks.append(mask)
        logits = torch.randn(1, VOCAB, generator=gen)
        apply_bitmask(logits, mask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert m.accept(token)
        tokens.append(token)
    twin = m.clone()
    assert twin.accept_tokens(tokens[:0]) == 0 and twin.num_tokens == m.num_tokens == 12

    def mask_of(matcher: Matcher) -> torch.Tensor:
        out = compiler.allocate_bitmask(1)
        matcher.fill_bitmask(out)
        return out

    replayed = compiler.matcher(compiler.compile(spec), tokens=tokens[:9])  # after a lost matcher
    m.rollback(3)  # e.g. 3 rejected draft tokens
    assert torch.equal(mask_of(m), masks[9]) and torch.equal(mask_of(replayed), masks[9])
    m.rollback(9)
    assert torch.equal(mask_of(m), masks[0])
    assert torch.equal(mask_of(twin), mask_of(compiler.matcher(spec, tokens=tokens)))  # the clone kept its state
    with pytest.raises(ValueError, match="rollback of 1 tokens"):
        m.rollback(1)


def test_eos_only_at_a_valid_end_and_termination(tok, compiler) -> None:  # noqa: ANN001
    mask = compiler.allocate_bitmask(1)
    m = compiler.matcher(StructuredSpec(choice=["yes", "no"]))
    m.fill_bitmask(mask)
    assert EOS not in allowed(mask) and not m.accept(EOS)
    yes = tok.encode("yes", add_special_tokens=False)
    assert not m.accept(tok.encode("maybe", add_special_tokens=False)[0])  # refused: state unchanged
    assert m.accept_tokens(yes) == len(yes)
    m.fill_bitmask(mask)
    assert m.is_terminated() and allowed(mask) == {EOS}  # nothing can follow "yes": the request ends now
    assert not m.accept(yes[0]) and m.num_tokens == len(yes)
    assert m.accept(EOS) and m.is_terminated() and not m.accept(EOS)
    m.rollback(1)  # the EOS
    assert m.is_terminated() and m.num_tokens == len(yes)
    # a regex that may go on: EOS is one choice among the digits
    r = compiler.matcher(StructuredSpec(regex="[0-9]{1,3}"), tokens=tok.encode("12", add_special_tokens=False))
    r.fill_bitmask(mask)
    assert EOS in allowed(mask) and not r.is_terminated() and r.is_accepting()
    assert r.accept(EOS) and r.is_terminated()
    r.rollback(1)
    assert not r.is_terminated()
    assert r.error is None


def test_a_wider_logits_row_never_allows_the_extra_ids(tok) -> None:  # noqa: ANN001
    wide = GrammarCompiler(tok, VOCAB + 64)
    m = wide.matcher(StructuredSpec(json_object=True), tokens=tok.encode('{"a": ', add_special_tokens=False))
    mask = wide.allocate_bitmask(1)
    m.fill_bitmask(mask)
    keep = allowed(mask)
    assert keep and max(keep) < VOCAB and not m.accept(VOCAB + 3)
    logits = torch.zeros(1, VOCAB + 64)
    wide.mask_logits(logits, [m])
    assert torch.isinf(logits[0, VOCAB:]).all()


def test_the_cache_compiles_a_spec_once(tok) -> None:  # noqa: ANN001
    compiler = GrammarCompiler(tok, VOCAB, max_cached=2)
    schema = SCHEMAS["bounded"]
    first = compiler.compile(StructuredSpec(json=schema))
    assert compiler.compile(StructuredSpec(json=json.dumps(schema))) is first  # same content, as text
    info = compiler.cache_info
    assert (info.num_compiled, info.num_hits, info.size) == (1, 1, 1)
    compiler.compile(StructuredSpec(regex="a+"))
    compiler.compile(StructuredSpec(regex="b+"))  # over max_cached=2: the schema, least recent, goes
    assert compiler.compile(StructuredSpec(json=schema)) is not first
    assert compiler.cache_info.num_compiled == 4 and compiler.cache_info.size == 2
    # property order is the output's order: a reordered schema is another grammar
    reordered = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    assert StructuredSpec(json=reordered) != StructuredSpec(json=schema)


def test_compile_and_matchers_from_many_threads(tok) -> None:  # noqa: ANN001
    compiler = GrammarCompiler(tok, VOCAB)
    specs = [StructuredSpec(json=s) for s in SCHEMAS.values()]
    made: list[Matcher] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for spec in specs * 3:
                made.append(compiler.matcher(compiler.compile(spec)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(made) == 4 * 3 * len(specs)
    assert compiler.cache_info.size == len(specs) and compiler.cache_info.num_hits >= 4 * 3 * len(specs) - 4 * len(
        specs)
    mask = compiler.allocate_bitmask(len(made))
    compiler.fill_bitmasks(made, mask)  # matchers made on other threads, used on this one
    assert all(allowed(mask, i) for i in range(len(made)))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, r"\['regex', 'choice'\]"),
    ({"json": "{"}, "json: not valid JSON"),
    ({"json": "[1]"}, "json: a JSON schema must be an object"),
    ({"json": {"x": {1, 2}}}, "json: the schema is not JSON-serializable"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": "ab"}, "choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "choice must hold strings"),
    ({"grammar": " "}, "grammar must be a non-empty string"),
    ({"regex": 5}, "regex must be a non-empty string"),
    ({"json_object": "yes"}, "json_object must be True or False"),
])
def test_invalid_specs_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredSpec(**kwargs)


@pytest.mark.parametrize(("spec", "match"), [
    (StructuredSpec(json={"type": "array", "uniqueItems": True}), r"(?s)json: .*uniqueItems"),
    (StructuredSpec(json={"type": "integer", "not": {"const": 0}}), r"(?s)json: .*not"),
    (StructuredSpec(json={"type": "integer", "minimum": 5, "maximum": 1}), r"(?s)json: .*minimum"),
    (StructuredSpec(json={"$ref": "#/$defs/missing"}), r"(?s)json: .*missing"),
    (StructuredSpec(json={"type": "strin"}), r"(?s)json: .*strin"),
    (StructuredSpec(regex="(a"), r"(?s)regex: .*unclosed group"),
    (StructuredSpec(regex=r"(a)\1"), r"(?s)regex: .*back"),
    (StructuredSpec(grammar="start: undefined_rule"), r"(?s)grammar: .*undefined_rule"),
])
def test_specs_the_library_cannot_compile_raise_value_error(compiler, spec: StructuredSpec, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        compiler.compile(spec)


def test_bad_arguments(tok, compiler) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(tok, 0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarCompiler(tok, VOCAB, eos_token_ids=[VOCAB])
    with pytest.raises(TypeError, match="StructuredSpec"):
        compiler.compile({"type": "object"})
    m = compiler.matcher(StructuredSpec(regex="ab"))
    with pytest.raises(ValueError, match=r"logits must be \[rows, 4096\]"):
        compiler.mask_logits(torch.zeros(1, VOCAB - 1), [m])
    with pytest.raises(ValueError, match="int32 CPU"):
        m.fill_bitmask(torch.zeros(1, VOCAB // 32))
    with pytest.raises(ValueError, match="does not match the grammar"):
        compiler.matcher(StructuredSpec(regex="ab"), tokens=[5, 6, 7])
    with pytest.raises(ValueError, match="1 bitmask rows for 2 logits rows"):
        apply_bitmask(torch.zeros(2, VOCAB), compiler.allocate_bitmask(1))
    with pytest.raises(ValueError, match="bitmask covers 4096 tokens, logits have 4097"):
        apply_bitmask(torch.zeros(1, VOCAB + 1), compiler.allocate_bitmask(1))


def test_a_schema_nested_past_the_stack_is_a_value_error():
    from hf_paged_attn.runtime.generation.structured import StructuredSpec

    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(ValueError, match="json: the schema is not JSON-serializable"):
        StructuredSpec(json=deep)


@pytest.mark.parametrize(("dtype", "path"), [(torch.float32, "native"), (torch.float32, "numpy"),
                                           (torch.float32, "torch"), (torch.bfloat16, "torch"),
                                           (torch.float64, "torch")])  # fmt: skip
@pytest.mark.parametrize("rows", [None, "in order", [4, 0, 2]])
def test_the_application_adds_minus_inf_where_a_bit_is_clear(dtype: torch.dtype, path: str, rows: object) -> None:
    """Every way (float32 CPU logits: the native loop, numpy without a compiler; torch for the others) against a
    plain loop over the bits, with NaN and +-inf logits (an add of -inf: NaN stays NaN, a forbidden +inf becomes
    NaN), a vocabulary that ends inside a word, and the rows left out untouched."""
    vocab, gen = 100, torch.Generator().manual_seed(3)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    logits[0, 7], logits[1, 8], logits[2, 9], logits[4, 31] = float("nan"), float("inf"), float("-inf"), float("inf")
    targets = list(range(5)) if rows in (None, "in order") else rows
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(targets), 4), dtype=torch.int32, generator=gen)
    expected = logits.clone().double()
    for i, row in enumerate(targets):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] += float("-inf")
    got = logits.clone()
    given = None if rows is None else targets
    if path == "native":
        assert cpu_bitmask.library() is not None  # the suite's machines have a C compiler
        apply_bitmask(got, bitmask, given)
    elif path == "numpy":
        apply_bitmask_numpy(got.numpy(), bitmask.numpy(), given)
    else:
        apply_bitmask_torch(got, bitmask, given)
    assert torch.equal(got.double().isnan(), expected.isnan())
    assert torch.equal(got.double().nan_to_num(), expected.to(dtype).double().nan_to_num())


def test_the_native_application_checks_what_it_is_given() -> None:
    """The C loop trusts its arguments: rows outside the logits are an error, tensors it does not read are left
    to numpy (False), a view of every other row is read at its stride."""
    logits, bitmask = torch.zeros(4, 64), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(IndexError, match=r"rows must lie in \[0, 4\), got 1 .. 4"):
        cpu_bitmask.apply(logits, bitmask, [1, 4])
    assert not cpu_bitmask.apply(logits.double(), bitmask, [0, 1])
    assert not cpu_bitmask.apply(logits[:, ::2], bitmask, [0, 1])  # not unit stride along the vocabulary
    assert not cpu_bitmask.apply(logits, torch.zeros(2, 1, dtype=torch.int32), [0, 1])  # 32 bits for 64 tokens
    every_other = logits[::2]  # rows 0 and 2, 128 floats apart
    assert cpu_bitmask.apply(every_other, bitmask, None)
    assert torch.isneginf(logits[[0, 2]]).all() and not logits[[1, 3]].any()


def test_without_a_c_compiler_the_application_is_numpys(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("CC", "no-such-compiler-hf-paged")
    monkeypatch.setenv("HF_PAGED_ATTN_CACHE", str(tmp_path))  # nothing cached there
    cpu_bitmask.library.cache_clear()
    try:
        assert cpu_bitmask.library() is None
        logits, bitmask = torch.zeros(2, 64), torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
        assert not cpu_bitmask.apply(logits, bitmask, None)
        apply_bitmask(logits, bitmask)  # token 0 allowed in row 0, token 32 in row 1
        assert logits[0, 0] == 0 and logits[1, 32] == 0 and torch.isneginf(logits).sum() == 2 * 63
    finally:
        cpu_bitmask.library.cache_clear()  # the next caller builds (or finds) the real one
