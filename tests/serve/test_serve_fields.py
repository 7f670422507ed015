"""Request fields real clients send (guidellm, lm-eval, OpenAI SDK users), each checked for its effect
with the official ``openai`` client against the session's uvicorn server (conftest.py)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .conftest import DEMO_NAME as NAME  # noqa: E402

TIMEOUT = 60.0
EOS_PROMPT = "A list is"  # the demo model's greedy completion ends with EOS after 13 tokens


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def streamed(chunks) -> tuple[str, str | None, list]:
    """(text, last finish_reason, chunks) of a streamed completion."""
    chunks = list(chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish, chunks


# ------------------------------------------------------------------------------- ignore_eos
@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_runs_to_max_tokens(client, stream):
    stopped = client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=24, temperature=0)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 24  # at EOS
    kwargs = {"model": NAME, "prompt": EOS_PROMPT, "max_tokens": 24, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    if stream:
        text, finish, chunks = streamed(client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        out = client.completions.create(**kwargs)
        text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert finish == "length" and usage.completion_tokens == 24
    assert text.startswith(stopped.choices[0].text) and len(text) > len(stopped.choices[0].text)


def test_ignore_eos_with_a_grammar_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="ignore_eos") as info:
        client.completions.create(model=NAME, prompt="x", max_tokens=4,
                                  extra_body={"ignore_eos": True, "guided_regex": "a+"})
    assert info.value.body["param"] == "ignore_eos"
