"""The server's pure parts, without a server: stop sequences and held-back text, request
validation, the benchmark's summary (its real run is the slow smoke at the end)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from transformers import AutoTokenizer  # noqa: E402

from hf_paged_attn.demo import DEMO_MODEL  # noqa: E402
from hf_paged_attn.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse  # noqa: E402
from hf_paged_attn.serve.text import IncrementalText, make_decoder  # noqa: E402
from hf_paged_attn_tools.bench import serve as bench_serve  # noqa: E402


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def char_decoder(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def feed(stream: IncrementalText, text: str) -> list[str]:
    """Feed ``text`` one character (token) at a time; the deltas sent, the last one final."""
    out = [stream.add([ord(c)]) for c in text[:-1]]
    return [*out, stream.add([ord(text[-1])], final=True)]


def test_text_without_stop_is_sent_as_it_comes():
    stream = IncrementalText(char_decoder, [])
    assert feed(stream, "abc") == ["a", "b", "c"]


def test_a_stop_sequence_is_cut_and_ends_the_text():
    stream = IncrementalText(char_decoder, ["END"])
    deltas = feed(stream, "xyENDzz")
    assert "".join(deltas) == "xy" and stream.stopped
    assert deltas[2:4] == ["", ""]  # "E", "EN" were held back: they could have been the stop


def test_held_back_text_is_released_when_it_turns_out_not_to_stop():
    stream = IncrementalText(char_decoder, ["END"])
    assert "".join(feed(stream, "aENx")) == "aENx" and not stream.stopped
    stream = IncrementalText(char_decoder, ["END"])
    assert stream.add(chars("aEN")) == "a"
    assert stream.add([], final=True) == "EN"  # the last output sends everything


def test_the_earliest_of_several_stops_wins_even_inside_one_step():
    stream = IncrementalText(char_decoder, ["cd", "b"])
    assert stream.add(chars("abcd")) == "a" and stream.stopped
    assert stream.add(chars("zz")) == ""


def test_half_a_utf8_character_waits_for_the_rest():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    ids = tokenizer("é ü", add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # byte-level BPE splits these characters
    stream = IncrementalText(make_decoder(tokenizer), [])
    deltas = [stream.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_the_fast_decoder_equals_tokenizer_decode():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    ids = tokenizer("<s>The for statement </s> x")["input_ids"]
    assert make_decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "x", "n": True}, "n"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "store": True}, "store"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages"),
    ],
)
def test_requests_we_cannot_honour_are_refused_by_name(body, param):
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(APIError) as info:
        parse(kind, body).stop_list()
    assert info.value.status == 400 and info.value.param == param


def test_accepted_neutral_values():
    req = parse(CompletionRequest, {"model": "m", "prompt": [1, 2], "presence_penalty": 0, "best_of": 1})
    assert req.max_tokens == 16 and req.stop_list() == []
    chat = parse(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}],
        "response_format": {"type": "text"}, "max_completion_tokens": 5, "stop": "x",
    })
    assert chat.token_limit() == 5 and chat.messages[0].text() == "a" and chat.stop_list() == ["x"]


def test_bench_summary():
    timings = [bench_serve.RequestTiming(sent=0.0, chunks=[0.1, 0.2, 0.4], num_tokens=3),
               bench_serve.RequestTiming(sent=0.0, chunks=[0.3, 0.35], num_tokens=2)]
    s = bench_serve.summarize(timings, wall=0.5)
    assert s["tokens_per_second"] == 10.0 and s["completion_tokens"] == 5
    assert s["ttft_p50_ms"] == 200.0 and s["ttft_p99_ms"] == 300.0
    assert s["itl_p50_ms"] == 100.0  # gaps 100, 200, 50 ms


@pytest.mark.slow
def test_bench_serve_smoke(tmp_path):
    report = bench_serve.run(["--smoke", "--out", str(tmp_path)])
    paged = report["systems"]["paged"]
    assert paged["completion_tokens"] > 0 and paged["tokens_per_second"] > 0
    assert (tmp_path / "serve_smoke.json").exists()


def _handlers():
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hf_paged_attn.serve.handlers import Handlers, ServeSettings

    def add_request(input_ids, max_new_tokens=None, generation_config=None, logprobs=None, seed=None, tokenizer=None):
        raise AssertionError("not called")

    text_config = SimpleNamespace(max_position_embeddings=1024)
    engine = SimpleNamespace(generation_config=GenerationConfig(do_sample=False, max_new_tokens=64),
                             model=SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text_config)),
                             add_request=add_request)
    return Handlers(SimpleNamespace(engine=engine), AutoTokenizer.from_pretrained(DEMO_MODEL), ServeSettings("m"))


def test_a_request_with_the_default_sampling_uses_the_engines_config_as_it_is():
    handlers = _handlers()
    job = lambda body: handlers._job(parse(CompletionRequest, {"model": "m", "prompt": "x", **body}), [[5]], [4], None)  # noqa: E731
    for body in ({}, {"temperature": 0}):  # greedy, as the engine's own config is
        assert "generation_config" not in job(body).engine_kwargs, body
    sampled = job({"temperature": 0.7, "top_p": 0.9}).engine_kwargs["generation_config"]
    assert (sampled.do_sample, sampled.temperature, sampled.top_p) == (True, 0.7, 0.9)
    stopped = job({"stop": "x"})  # stop sequences are the server's own: no vocabulary-sized table in the engine
    assert stopped.stop == ["x"] and "generation_config" not in stopped.engine_kwargs
    assert "tokenizer" not in stopped.engine_kwargs
    assert handlers.generation_config.do_sample is False and handlers.generation_config.stop_strings is None
