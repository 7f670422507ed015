"""Tool calls in a model's output, parsed as the text streams in: OpenAI's ``message.tool_calls``.

Two formats (``ToolCallFormat``): Hermes / Qwen, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
anywhere in the output, as many as the model writes; Llama 3 (JSON tool calling), the output *is*
``{"name": ..., "parameters": {...}}`` (after an optional ``<|python_tag|>``), several joined by ``;``.
Either key, ``arguments`` or ``parameters``, is read in both. Which one a model uses: ``detect_format``
reads its chat template.

``ToolCallStream.feed(text)`` takes the text deltas of one choice and returns what may be sent: content
text, and tool-call deltas as OpenAI streams them (the first of a call carries ``id``, ``type`` and
``function.name``, later ones ``function.arguments`` fragments, each with the call's ``index``).
The arguments are the raw JSON text the model wrote (an object streams as it grows; a JSON string
holding an object is sent decoded, once complete). A complete response is the same deltas folded
(``parse_tool_calls``), so streamed and whole answers agree.

Content is the text outside calls, as written, except whitespace next to a call (dropped). Text that
could still open a call is held back until the next text decides it. What does not parse as a call
(no string ``name``, broken JSON before the name) is content after all; a call cut short by
``max_tokens`` keeps what was sent of its arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .json_scan import ARGUMENT_KEYS, ObjectScanner

PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # what opens a call ("" : a JSON object at the start of the output, or after a separator)
    end: str  # what closes it ("" : the object's end)
    arguments_key: str  # in a forced call
    separator: str  # between the calls of a forced parallel call


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "arguments", "\n")
LLAMA3 = ToolCallFormat("llama3", "", "", "parameters", "; ")
FORMATS = {f.name: f for f in (HERMES, LLAMA3)}


def detect_format(template: str | None, choice: str = "auto") -> ToolCallFormat:
    """``choice`` ("hermes", "llama3"), or for "auto" the one the chat template writes (Hermes by default)."""
    if choice != "auto":
        if choice not in FORMATS:
            raise ValueError(f"tool-call parser must be auto, {', '.join(FORMATS)}; got {choice!r}")
        return FORMATS[choice]
    template = template or ""
    if "<tool_call>" in template:
        return HERMES
    if PYTHON_TAG in template or '"parameters"' in template:
        return LLAMA3
    return HERMES


@dataclass
class Delta:
    """What one ``feed`` lets out: content text and OpenAI tool-call deltas."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Call:
    index: int
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    scanner: ObjectScanner = field(default_factory=ObjectScanner)
    opened: str = ""  # the text that opened it (the start marker), content again if it is not a call
    announced: bool = False  # its first delta (id, name) was sent
    num_sent: int = 0  # characters of the arguments' raw text sent


class ToolCallStream:
    """Tool calls and content of one choice, from its text deltas (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.pending = ""  # received, not yet decided
        self.state = "text"  # text, call, after, plain (no call can come any more)
        self.call: _Call | None = None
        self.num_calls = 0  # announced
        self.at_start = True  # Llama 3: a call may begin here
        self.strip_leading = False  # just after a call: leading whitespace is dropped

    def feed(self, text: str, final: bool = False) -> Delta:
        out = Delta()
        self.pending += text
        while self._advance(out, final):
            pass
        if final:
            self._finish(out)
        return out

    # ----------------------------------------------------------------------------- the states
    def _advance(self, out: Delta, final: bool) -> bool:
        """Take what it can of ``pending``; True if the state changed (look again)."""
        if self.state == "plain":
            self._content(out, self.pending, final=True)
            self.pending = ""
            return False
        if self.state == "text":
            return self._text(out, final)
        if self.state == "call":
            return self._in_call(out)
        return self._after(out, final)

    def _text(self, out: Delta, final: bool) -> bool:
        if not self.fmt.start:  # Llama 3: a call only where one may begin
            head = self.pending.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG) :].lstrip()
            if self.at_start and head.startswith("{"):
                self._open(self.pending[: len(self.pending) - len(head)])
                self.pending = head
                return True
            if self.at_start and not final and (not head or PYTHON_TAG.startswith(head)):
                return False  # still undecided
            self.state = "plain"
            return True
        at = self.pending.find(self.fmt.start)
        if at >= 0:
            before = self.pending[:at].rstrip()
            self._content(out, before, final=True)
            self._open(self.pending[len(before) : at + len(self.fmt.start)])  # whitespace too, should it be content
            self.pending = self.pending[at + len(self.fmt.start) :]
            return True
        keep = 0 if final else _partial_suffix(self.pending, self.fmt.start)
        used = self._content(out, self.pending[: len(self.pending) - keep], final)
        self.pending = self.pending[used:]
        return False

    def _content(self, out: Delta, text: str, final: bool) -> int:
        """Send ``text`` as content; returns how many of its characters are used. Unless ``final``, its
        trailing whitespace is held back (a call may follow); whitespace right after a call is dropped."""
        used = len(text)
        if self.strip_leading:
            text = text.lstrip()
            if not text:
                return used
        if not final:
            body = text.rstrip()
            used -= len(text) - len(body)
            text = body
        if text:
            out.content += text
            self.strip_leading = False
        return used

    def _open(self, opened: str) -> None:
        self.call = _Call(self.num_calls, opened=opened)
        self.state = "call"
        self.at_start = False

    def _in_call(self, out: Delta) -> bool:
        call = self.call
        assert call is not None
        scanner = call.scanner
        before = len(scanner.text)
        scanner.feed(self.pending)
        self.pending = self.pending[len(scanner.text) - before :]
        if not call.announced and (scanner.phase == "error" or self._not_a_call(scanner)):
            self._not_a_tool_call(out, call)
            return True
        name = scanner.name()
        if name is not None and not call.announced:
            call.announced = True
            self.num_calls += 1
            out.tool_calls.append({"index": call.index, "id": call.id, "type": "function",
                                   "function": {"name": name, "arguments": ""}})
        if call.announced:
            self._send_arguments(out, call, complete=scanner.phase in ("done", "error"))
        if scanner.phase in ("done", "error"):
            if not call.announced:  # a complete object without a name
                self._not_a_tool_call(out, call)
                return True
            self.state, self.call, self.strip_leading = "after", None, True
            return True
        return False

    def _not_a_call(self, scanner: ObjectScanner) -> bool:
        """Llama 3: the object's first member says whether it is a call; other formats wait for the end."""
        if self.fmt.start or not scanner.values and scanner.key is None:
            return False
        first = next(iter(scanner.values), scanner.key)
        return first not in ("name", *ARGUMENT_KEYS)

    def _not_a_tool_call(self, out: Delta, call: _Call) -> None:
        """What opened as a call is content after all, and so is everything after it."""
        self.pending = call.opened + call.scanner.text + self.pending
        self.state, self.call = "plain", None

    def _send_arguments(self, out: Delta, call: _Call, complete: bool) -> None:
        scanner = call.scanner
        key = scanner.arguments_key
        if key is None:
            if complete and not call.num_sent:  # no arguments written
                self._fragment(out, call, "{}")
            return
        if key in scanner.values:  # complete
            raw = scanner.values[key]
            if raw.startswith('"'):  # arguments written as a JSON string holding the object
                try:
                    raw = json.loads(raw)
                except ValueError:
                    pass
                raw = raw if isinstance(raw, str) else json.dumps(raw)
            self._fragment(out, call, raw[call.num_sent :])
        elif scanner.text[scanner.value_start] in "{[":  # an object or array: send it as it grows
            self._fragment(out, call, scanner.text[scanner.value_start + call.num_sent :])

    def _fragment(self, out: Delta, call: _Call, text: str) -> None:
        if not text:
            return
        call.num_sent += len(text)
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last["index"] == call.index and "id" not in last:  # the header stays on its own
            last["function"]["arguments"] += text
        else:
            out.tool_calls.append({"index": call.index, "function": {"arguments": text}})

    def _after(self, out: Delta, final: bool) -> bool:
        """After a call: the end marker (Hermes) or a separator and the next call (Llama 3)."""
        head = self.pending.lstrip()
        end = self.fmt.end
        if end:
            if head.startswith(end):
                self.pending = head[len(end) :]
            elif end.startswith(head):  # the marker may still come; cut short at the end: dropped
                if not final:
                    return False
                self.pending = ""
            self.state = "text"  # (without an end marker: carry on as text)
            return True
        if head.startswith(";"):
            self.pending = head[1:]
            self.state, self.at_start = "text", True
            return True
        if not head and not final:
            return False
        self.state = "text"
        return True

    def _finish(self, out: Delta) -> None:
        """The end of the output: a call that never got its name is content after all."""
        if self.state == "call" and self.call is not None and not self.call.announced:
            self._not_a_tool_call(out, self.call)
            self._advance(out, final=True)
        self.pending = ""


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output: ``ToolCallStream``'s deltas folded. Content is None
    when there are tool calls and no other text; without tool calls it is ``text`` as it is."""
    delta = ToolCallStream(fmt).feed(text, final=True)
    calls: list[dict[str, Any]] = []
    for d in delta.tool_calls:
        if "id" in d:
            calls.append({"id": d["id"], "type": "function",
                          "function": {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    content = delta.content
    return (content or None) if calls else content, calls
