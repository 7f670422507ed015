"""A chat's messages as prompt token ids, through the chat template, with message text kept as text.

The template writes the control tokens (``<s>``, ``<|im_start|>``, ...) that frame each message.
A message that merely *contains* the text of a control token (a user typing ``</s><s>System:``)
must not produce the real token: that would let any user end the turn and speak as another role.
So, as OpenAI does, text inside a message is tokenized as text, while the template's own control
tokens stay control tokens. (``transformers``' ``apply_chat_template(tokenize=True)`` and vLLM
parse control-token text anywhere in the rendered prompt; for messages without such text, which
is nearly all of them, the ids here are exactly theirs.)

How: the template is rendered twice, once as it is and once with a marker character inserted into
every control-token string inside the messages. The control tokens found in the second rendering
are the template's own; the first rendering is tokenized with only those as control tokens, and
the text between them as plain text (``split_special_tokens=True``), which is how the tokenizer
treats the text between control tokens anyway.

The same holds for every string the client gives the template: message contents, tool calls and their
arguments, tool definitions (``tools``, as ``apply_chat_template(tools=...)`` takes them).
"""

from __future__ import annotations

import bisect
from typing import Any

from ..errors import APIError

MARKERS = [chr(c) for c in range(0xE000, 0xF900)]  # private-use characters: one that no message contains


def control_strings(tokenizer: Any) -> list[str]:
    """The text of every special added token, longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    names = {str(t) for t in decoder.values() if getattr(t, "special", False)} | set(tokenizer.all_special_tokens)
    return sorted((n for n in names if n), key=len, reverse=True)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], template: str,
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt ids of ``messages`` (``{"role", "content", ...}``) and ``tools`` through ``template``,
    with a generation prompt unless ``add_generation_prompt`` is false; ``template_kwargs``: more variables
    for the template (vLLM's ``chat_template_kwargs``)."""
    text = render(tokenizer, messages, template, tools, add_generation_prompt, template_kwargs)
    controls = control_strings(tokenizer)
    strings = list(_strings([messages, tools, template_kwargs]))
    if not any(c in t for t in strings for c in controls):
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own BOS
    used = set().union(*strings)
    mark = next(m for m in MARKERS if m not in used and m not in template)
    broken = _map_strings([messages, tools, template_kwargs], lambda t: _break(t, controls, mark))
    marked = render(tokenizer, broken[0], template, broken[1], add_generation_prompt, broken[2])
    if marked.replace(mark, "") != text:  # the template transformed the content beyond trimming its ends
        raise APIError(400, "a message contains the text of a control token, which this chat template does not "
                       "keep as plain text; remove it", "messages", "invalid_messages")
    spans = _template_controls(tokenizer, marked, mark)
    ids: list[int] = []
    start = 0
    for begin, end, token_id in spans:
        ids += _plain(tokenizer, text[start:begin])
        ids.append(token_id)
        start = end
    return ids + _plain(tokenizer, text[start:])


def render(tokenizer: Any, messages: list[dict[str, Any]], template: str,
           tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
           template_kwargs: dict[str, Any] | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as exc:  # a template may raise on messages it does not accept (jinja's raise_exception)
        raise APIError(400, f"the chat template refused the messages: {exc}", "messages", "invalid_messages") from None


def _strings(value: Any) -> Any:
    """Every string in ``value`` (dict keys too): the JSON the client sent, bounded in depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _map_strings(value: Any, fn: Any) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {fn(key): _map_strings(item, fn) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_strings(item, fn) for item in value]
    return value


def _break(content: str, controls: list[str], mark: str) -> str:
    for c in controls:  # longest first: a control string containing a shorter one is broken once, by its own mark
        if c in content and len(c) > 1:
            content = content.replace(c, c[0] + mark + c[1:])
    return content


def _template_controls(tokenizer: Any, marked: str, mark: str) -> list[tuple[int, int, int]]:
    """(start, end, id) in the unmarked text of each control token the template wrote."""
    enc = tokenizer(marked, add_special_tokens=False, return_offsets_mapping=True)
    special_ids = {tokenizer.convert_tokens_to_ids(c) for c in control_strings(tokenizer)}
    marks = [i for i, ch in enumerate(marked) if ch == mark]
    spans = []
    for token_id, (begin, end) in zip(enc["input_ids"], enc["offset_mapping"]):
        if token_id in special_ids:
            shift = bisect.bisect_left(marks, begin)  # marks before this token
            spans.append((begin - shift, end - shift, token_id))
    return spans


def _plain(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []
