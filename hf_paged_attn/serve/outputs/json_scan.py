"""One JSON object read a character at a time, as a model writes it: where each top-level member's
value lies in the text, and where the object ends (``tool_parser`` streams a call's arguments from it)."""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")  # the member holding a tool call's arguments, in either format


class ObjectScanner:
    """One JSON object read a character at a time: where each top-level member's value lies in the
    text and where the object ends. It follows the structure only; it is not a validator."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.phase = "start"  # start, key, colon, value_wait, value, comma, done, error
        self.key_start = 0
        self.key: str | None = None  # of the member being read
        self.value_start = 0
        self.values: dict[str, str] = {}  # raw text of each complete member's value

    def feed(self, text: str) -> None:
        """Read ``text``; stops at the object's end (``phase == "done"``; ``self.text`` ends there) or an error."""
        if self.phase in ("done", "error"):
            return
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            self._step(self.text[i], i)
            if self.phase in ("done", "error"):
                self.text = self.text[: i + 1]
                return

    def _step(self, c: str, i: int) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1 and self.phase == "key":
                    try:
                        self.key = json.loads(self.text[self.key_start : i + 1])
                    except ValueError:
                        self.phase = "error"
                        return
                    self.phase = "colon"
                elif self.depth == 1 and self.phase == "value":
                    self._value_done(i + 1, "comma")
            return
        if self.phase == "value" and self.depth > 1:
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_done(i + 1, "comma")
            return
        if c.isspace() and self.phase != "value":
            return
        if self.phase == "start":
            self._expect(c == "{", "key")
            self.depth = 1
        elif self.phase == "key":
            if c == '"':
                self.in_string, self.key_start = True, i
            else:
                self._expect(c == "}" and not self.values, "done")
        elif self.phase == "colon":
            self._expect(c == ":", "value_wait")
        elif self.phase == "value_wait":
            self.phase, self.value_start = "value", i
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in ",}]":
                self.phase = "error"
        elif self.phase == "value":  # a number, true, false or null at depth 1
            if c == ",":
                self._value_done(i, "key")
            elif c == "}":
                self._value_done(i, "done")
        elif self.phase == "comma":
            self._expect(c in ",}", "key" if c == "," else "done")

    def _expect(self, ok: bool, phase: str) -> None:
        self.phase = phase if ok else "error"

    def _value_done(self, end: int, phase: str) -> None:
        assert self.key is not None
        self.values[self.key] = self.text[self.value_start : end].strip()
        self.key, self.phase = None, phase

    @property
    def arguments_key(self) -> str | None:
        """The member holding the arguments, once its value has begun (or is complete)."""
        for key in ARGUMENT_KEYS:
            if key in self.values or (self.key == key and self.phase == "value"):
                return key
        return None

    def name(self) -> str | None:
        raw = self.values.get("name")
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        return value if isinstance(value, str) else None
