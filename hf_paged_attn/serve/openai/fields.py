"""Bounded field types of the request models: strings of valid Unicode and bounded length, maps of
bounded size, and JSON values (schemas) of bounded nesting and size."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

MAX_JSON_DEPTH = 64  # nesting of a schema (objects and arrays); llguidance refuses ~400 levels itself
# Values in one schema (every object, array, string, number), and in all the tools of a forced call together.
# Compile time grows with the square of an object's optional properties: 5,000 (OpenAI's bound, ~10,000
# values) take ~4 s on a shared 2-core machine, in the server's grammar thread (docs/serving.md).
MAX_JSON_NODES = 10_000


def valid_unicode(text: str) -> str:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: JSON's "\ud800" escape, or CESU-8 decoded leniently
            raise PydanticCustomError(
                "lone_surrogate", "text must be valid Unicode; found a lone surrogate U+{code} at index {index}",
                {"code": f"{ord(text[exc.start]):04X}", "index": exc.start},
            ) from None
    return text


def text(max_length: int | None = None, min_length: int = 0) -> Any:
    """``str`` of bounded length and valid Unicode (the length is checked first: cheap)."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length), AfterValidator(valid_unicode)]


def max_items(limit: int) -> Any:
    """A check for maps whose values pydantic validates one by one: refuse a million entries before
    pydantic builds a million errors (it stops early on a list's max_length, not on a dict's)."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and len(value) > limit:
            raise PydanticCustomError("too_long", "at most {limit} entries, got {count}",
                                      {"limit": limit, "count": len(value)})
        return value

    return check


def json_bounds(value: Any, what: str = "a JSON schema") -> int:
    """PydanticCustomError unless ``value`` nests at most MAX_JSON_DEPTH deep, holds at most
    MAX_JSON_NODES values and only valid Unicode (keys too). Iterative: a deep value must not recurse
    here, and Python's ``json`` (the engine serializes a schema) recurses. Returns the number of values."""
    stack = [(value, 1)]
    num_nodes = 0
    while stack:
        item, depth = stack.pop()
        num_nodes += 1
        if num_nodes > MAX_JSON_NODES:
            raise PydanticCustomError("too_large", "{what} has more than {limit} values",
                                      {"what": what, "limit": MAX_JSON_NODES})
        if isinstance(item, (dict, list)) and depth > MAX_JSON_DEPTH:
            raise PydanticCustomError("too_deep", "{what} nests deeper than {limit} levels",
                                      {"what": what, "limit": MAX_JSON_DEPTH})
        if isinstance(item, dict):
            for key, child in item.items():
                valid_unicode(key)
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            valid_unicode(item)
    return num_nodes
