"""The server's bounds on what one client can cost, in one place (plain constants: the command
line reads its defaults here without loading the web stack)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: a prompt of about a million characters, or ~500k token ids
DEFAULT_BODY_TIMEOUT_S = 60.0  # for a POST body to arrive (408 after)
CHARS_PER_TOKEN = 32  # default prompt bound, in characters per token of the model's context: far above real text
# JSON, validation, the chat template and the tokenizer run in this many threads, off the event loop. One:
# transformers flips the Rust tokenizer's state (``encode_special_tokens`` for split_special_tokens=True,
# truncation, padding) before encoding, and the Rust tokenizer refuses a change ("Already borrowed") while
# another thread encodes with the GIL released; in one thread every call sees its own settings.
TOKENIZER_THREADS = 1
DRAIN_GRACE_S = 5  # after the drain deadline aborts every request, for the streams to send their last events
MAX_HEADER_BYTES = 64 << 10  # uvicorn's h11 parser (--http h11); httptools has no such bound


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds of a request that depend on the served model and the server's settings."""

    vocab_size: int  # token ids in a prompt must be below it
    max_prompt_chars: int  # characters of one completions prompt, or of a chat's messages together
    max_choices: int  # engine requests (prompts x n) one HTTP request may start: the queue's size
