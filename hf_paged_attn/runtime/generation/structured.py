r"""Structured outputs: grammar-constrained decoding (a JSON schema, any JSON object, a regex, a list of
choices, or a Lark / GBNF grammar), on llguidance.

One ``GrammarCompiler`` per engine turns a ``StructuredSpec`` into a ``CompiledGrammar`` (cached by
content, bounded LRU, thread-safe); each request (each child of ``n > 1`` too) gets its own
``Matcher``. Each step the engine fills the bitmasks of its constrained rows in one call that runs
in Rust with the GIL released, and sets the logits of forbidden tokens to ``-inf`` with one add,
before logits processors and sampling::

    grammar = compiler.compile(StructuredSpec(json=schema))            # add_request (any thread)
    matcher = compiler.matcher(grammar)
    compiler.mask_logits(logits, [matcher, ...], rows=[2, ...])        # each step, before sampling
    matcher.accept(token)                                              # each sampled token
    matcher.is_terminated()                                            # True: the request ends now

**EOS.** The mask allows the EOS token(s) (``eos_token_ids``) only where the output so far is a
complete match. Once the grammar can go no further (``{"a": 1}`` of a closed object, the last
character of a choice) the mask allows EOS only and ``is_terminated()`` is true: the request must
end then, without running one more step for the EOS. A sampled EOS at a valid end is accepted and
terminates the matcher too.

**Why llguidance, not xgrammar** (both CPU wheels; ``benchmarks/structured_backends.py``: one
process, this 2-core shared box, 1 fill thread, 32 constrained rows in lockstep, medians, p90):

- correctness decides. xgrammar 0.2.8 silently ignores JSON Schema keywords it lacks: ``allOf``,
  ``if/then``, ``not`` and ``dependentRequired`` gave outputs that fail ``jsonschema`` validation,
  and ``type: [string, null]`` with ``maxLength``, or ``propertyNames``, let raw control characters
  into strings (not JSON at all). llguidance refuses what it lacks and names it
  (``Unimplemented keys: ["uniqueItems"]``; likewise ``not``, ``if``, ``dependentRequired``,
  ``propertyNames``), which is what a server must answer with a 400. Everything else probed passed
  both (enum, const, bounded and exclusive numbers, multipleOf, min/maxLength, pattern, date-time /
  uuid formats, min/maxItems, prefixItems, nested objects, $ref and recursive $ref, anyOf, oneOf,
  type lists, additionalProperties / patternProperties schemas, Lark and GBNF grammars).
- regex: llguidance takes ``(?i)``-style flags, xgrammar refuses them; neither does look-around or
  back-references. llguidance's ``\d`` and ``\w`` are Unicode classes (Rust ``regex``).
- mask fill, 32 rows (load 1.3): vocab 4096 xgrammar 0.08 ms (p90 0.36), llguidance 0.24 ms
  (0.35); a 128k byte-level BPE xgrammar 0.16 ms (6.0), llguidance 0.65 ms (2.0). Both are far
  below a decode step, and a step waits for its slowest row: llguidance's tail is a third of
  xgrammar's. This module's whole per-step cost for 32 rows of the demo vocabulary (fill + apply
  0.41 ms, p90 0.57; accepts 0.07 ms) is 4% of the demo model's decode step (10.7 ms for 32
  requests, 16.5 ms for 64, 2 threads): constrained rows run at ~0.95x the free ones.
- compile, cold / cached: vocab 4096 both 0.3-4 ms / under 0.1 ms; 128k xgrammar up to 93-113 ms
  cold (it precomputes token masks), llguidance under 1 ms after a first one of 5-23 ms (its lexer
  grows lazily as it is used).
- applying the mask is ours for both: on the CPU one native loop over the words (0.03 ms for 32 rows x 4096,
  0.8 ms for 32 x 128k, where torch's ops took 0.14 and 12; xgrammar's own CPU kernel was slower still); on a
  GPU it is a few small kernels.
- llguidance's batch fill releases the GIL (a Python thread ran at full speed beside it;
  xgrammar's held it: 0.44-0.8x over four runs), so the engine's fill need not stall the server's
  event loop, and can run in a thread beside the forward.
- both offer rollback, copies and parallel fills; llguidance has no dependencies, xgrammar brings
  apache-tvm-ffi and pydantic and constrains torch, transformers and triton.

**Conventions.** JSON output has no free whitespace and ``json.dumps``'s separators (``", "`` and
``": "``) unless ``any_whitespace=True``: small models left free whitespace can loop on newlines
forever. A schema is enforced as written: properties it does not close with
``additionalProperties: false`` may be added by the model (JSON Schema's default; OpenAI's strict
schemas close every object). A regex matches the whole output.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...kernels import cpu_bitmask

try:
    import llguidance
    import llguidance.hf
    import llguidance.torch
except ImportError as e:  # an optional extra: only a server or engine that takes structured requests needs it
    raise ImportError("structured outputs need llguidance: pip install 'hf-paged-attn[structured]'") from e

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """What one request's output must match: exactly one field is set.

    ``json``: a JSON schema (dict, or its JSON text); ``json_object``: any JSON object; ``regex``: the
    whole output matches it (Rust ``regex`` syntax: no look-around, no back-references); ``choice``:
    the output is one of these strings; ``grammar``: a Lark grammar (``start:`` rule) or a GBNF one
    (``root ::=``, as llama.cpp and vLLM take it). Equal specs hash equal (``key``).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if _is_set(self, k)]
        if len(chosen) != 1:
            raise ValueError(f"StructuredSpec takes exactly one of {', '.join(_KINDS)}; got {chosen or 'none'}")
        kind = chosen[0]
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"json: not valid JSON text ({e})") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json: a JSON schema must be an object, got {type(schema).__name__}")
            try:
                text = json.dumps(schema, ensure_ascii=False)  # keeps the property order: it is the output's
            except (TypeError, ValueError, RecursionError) as e:  # a cycle, or nesting deeper than Python's stack
                raise ValueError(f"json: the schema is not JSON-serializable ({type(e).__name__}: {e})") from None
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError(f"json_object must be True or False, got {self.json_object!r}")
            text = ""
        elif kind == "choice":
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice:
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
            bad = [c for c in self.choice if not isinstance(c, str)]
            if bad:
                raise ValueError(f"choice must hold strings only, got {bad[0]!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
            text = json.dumps(self.choice, ensure_ascii=False)
        else:
            text = getattr(self, kind)
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{kind} must be a non-empty string, got {text!r}")
        object.__setattr__(self, "key", (kind, text))

    @property
    def kind(self) -> str:
        """Which field is set: ``"json"``, ``"json_object"``, ``"regex"``, ``"choice"`` or ``"grammar"``."""
        return self.key[0]

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredSpec) and self.key == other.key


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled spec: a matcher in its start state that every new ``Matcher`` copies (never advanced)."""

    spec: StructuredSpec
    _template: llguidance.LLMatcher = field(repr=False)
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CacheInfo:
    num_compiled: int  # specs compiled (cache misses)
    num_hits: int
    size: int  # grammars held now
    max_size: int


class Matcher:
    """One request's position in its grammar. Used by one thread at a time (the engine's).

    ``accept`` refuses a token the mask forbids and leaves the state as it was. After a preemption by
    recompute the engine keeps the request's matcher: it follows the tokens, which do not change, not
    the KV cache. A matcher that was lost is rebuilt with ``compiler.matcher(grammar, tokens=output)``
    (replays ``accept``).
    """

    __slots__ = ("_m", "_eos", "_ended", "num_tokens", "compiler")

    def __init__(
        self, m: llguidance.LLMatcher, eos_token_ids: tuple[int, ...], compiler: GrammarCompiler | None = None
    ) -> None:
        self._m = m
        self._eos = eos_token_ids
        self.compiler = compiler  # whose threads fill this matcher's mask with others' (``mask_rows``)
        self._ended = False  # an EOS accepted after the grammar had stopped: llguidance does not record it
        self.num_tokens = 0  # tokens accepted; ``rollback`` goes back at most this many

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) if the grammar does not allow it here."""
        if self._ended:
            return False
        if self._m.is_stopped():
            if token not in self._eos or self._m.is_error():
                return False
            self._ended = True
        elif self._m.try_consume_tokens([token]) != 1:
            return False
        self.num_tokens += 1
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        """Advance by each of ``tokens`` in turn; how many were accepted (stops at the first refused)."""
        for i, token in enumerate(tokens):
            if not self.accept(int(token)):
                return i
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding: rejected draft tokens)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"rollback of {num_tokens} tokens; this matcher accepted {self.num_tokens}")
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
            self.num_tokens -= 1
        if num_tokens:
            ok = self._m.rollback(num_tokens)
            assert ok, self._m.get_error()
            self.num_tokens -= num_tokens

    @property
    def ended(self) -> bool:
        """Whether an EOS was accepted after the grammar had stopped."""
        return self._ended

    def is_terminated(self) -> bool:
        """True once no token but EOS may follow (or EOS was accepted): the request must end now."""
        return self._ended or self._m.is_stopped()

    def is_accepting(self) -> bool:
        """True where the output so far is a complete match (EOS is allowed next, or was taken)."""
        return self._ended or self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """The library's error (a resource limit hit mid-parse); None while all is well."""
        if not self._m.is_error():
            return None
        return self._m.get_error() or "unknown error"

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]``: int32 CPU ``[rows, ceil(vocab / 32)]``,
        bit ``t % 32`` of word ``t // 32`` set for an allowed token ``t``. Does not change the state."""
        _check_bitmask(bitmask, row + 1)
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def clone(self) -> Matcher:
        """An independent copy in the same state (a child of ``n > 1``, a beam)."""
        twin = Matcher(self._m.deep_copy(), self._eos, self.compiler)
        twin._ended, twin.num_tokens = self._ended, self.num_tokens
        return twin


class GrammarCompiler:
    """Compiles specs for one tokenizer and logits width; caches them by content (LRU of ``max_cached``).

    ``tokenizer``: the model's fast Hugging Face tokenizer. ``vocab_size``: the logits' last dimension
    (may exceed ``len(tokenizer)``: the extra ids are never allowed). ``eos_token_ids``: the tokens the
    mask allows at a valid end (default: the tokenizer's EOS; pass the generation config's list).
    ``any_whitespace``: let JSON have free whitespace between tokens. ``num_threads``: the mask-fill
    threads (None: llguidance's default, 80% of the CPUs up to 32).

    ``compile`` and ``matcher`` may be called from any thread; ``fill_bitmasks`` / ``mask_logits``
    from one thread at a time (the engine's).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        eos_token_ids: Sequence[int] | None = None,
        max_cached: int = 256,
        any_whitespace: bool = False,
        num_threads: int | None = None,
    ) -> None:
        if not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        if max_cached < 1:
            raise ValueError(f"max_cached must be at least 1, got {max_cached}")
        if eos_token_ids is None:
            eos_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        eos = tuple(int(t) for t in eos_token_ids)
        if not eos or not all(0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be token ids below vocab_size={vocab_size}, got {list(eos)}")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self.max_cached = max_cached
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos))
        # \uXXXX escapes of any character, as json.dumps writes non-ASCII text by default
        self._json_options: dict[str, Any] = {"json_allow_general_unicode_escapes": True}
        if any_whitespace:
            self._json_options["whitespace_flexible"] = True
        else:
            self._json_options.update(whitespace_flexible=False, item_separator=", ", key_separator=": ")
        self._executor = llguidance.LLExecutor(num_threads)
        cpu_bitmask.library()  # built here (once per machine, then cached), not in the first constrained step
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._num_compiled = 0
        self._num_hits = 0

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``; ValueError naming the field (and the library's reason,
        e.g. ``Unimplemented keys: ["uniqueItems"]``) if it cannot be compiled."""
        if not isinstance(spec, StructuredSpec):
            raise TypeError(f"compile takes a StructuredSpec, got {type(spec).__name__}")
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self._num_hits += 1
                return hit
        # Outside the lock: building the matcher can take 100 ms+ for a large grammar (with the GIL
        # released); two threads compiling one new spec at once both compile, and one result is kept.
        template = llguidance.LLMatcher(self._tokenizer, self._grammar_text(spec), log_level=0)
        if template.is_error():
            raise ValueError(f"{spec.kind}: {template.get_error().strip()[:2000]}")
        compiled = CompiledGrammar(spec, template, self.eos_token_ids)
        with self._lock:
            self._num_compiled += 1
            compiled = self._cache.setdefault(spec.key, compiled)
            self._cache.move_to_end(spec.key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, grammar: CompiledGrammar | StructuredSpec, tokens: Sequence[int] = ()) -> Matcher:
        """A new matcher at the start of ``grammar``, then advanced through ``tokens`` (a request's
        output so far, to rebuild a lost matcher); ValueError if one of them is refused."""
        if isinstance(grammar, StructuredSpec):
            grammar = self.compile(grammar)
        with self._lock:  # one copy at a time of a template shared by every thread
            m = Matcher(grammar._template.deep_copy(), grammar.eos_token_ids, self)
        num = m.accept_tokens(tokens)
        if num != len(tokens):
            raise ValueError(f"token {tokens[num]} at output position {num} does not match the grammar")
        return m

    def allocate_bitmask(self, num_rows: int, pin_memory: bool = False) -> torch.Tensor:
        """An int32 CPU bitmask ``[num_rows, ceil(vocab_size / 32)]`` (pinned: for a copy to a GPU)."""
        words = (self.vocab_size + 31) // 32
        return torch.empty(num_rows, words, dtype=torch.int32, pin_memory=pin_memory)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` gets ``matchers[i]``'s mask: all rows in one call, on the library's
        threads, with the GIL released. The same as ``matchers[i].fill_bitmask(bitmask, i)`` for each ``i``."""
        self.bitmask_filler(matchers, bitmask)()

    def bitmask_filler(self, matchers: Sequence[Matcher], bitmask: torch.Tensor) -> Callable[[], None]:
        """``fill_bitmasks(matchers, bitmask)`` as a call prepared now (checks, arguments): run on another thread,
        it runs no Python before the library's native call releases the GIL, so the thread that prepared it waits
        less for the GIL (``mask_prefill.py``). The caller keeps ``bitmask`` alive until the call has run."""
        _check_bitmask(bitmask, len(matchers))
        if bitmask.shape[1] * 32 < self.vocab_size:
            raise ValueError(f"bitmask has {bitmask.shape[1]} words per row; vocab_size={self.vocab_size}")
        pairs = [(m._m, i) for i, m in enumerate(matchers)]
        # what llguidance.torch.fill_next_token_bitmask_par calls, after its checks (done above)
        return functools.partial(self._executor.unsafe_compute_mask_ptr, pairs, bitmask.data_ptr(),
                                 bitmask.shape[1] * 4, bitmask.shape[0])  # fmt: skip

    def mask_logits(self, logits: torch.Tensor, matchers: Sequence[Matcher], rows: Sequence[int] | None = None) -> None:
        """Set to ``-inf``, in place, the logits of the tokens each matcher forbids.

        ``logits``: ``[num_rows, vocab_size]`` float, any device. ``rows[i]``: the logits row of
        ``matchers[i]`` (None: row ``i``). Rows without a matcher are left alone. A matcher whose
        request failed (``accept`` refused a token) must not be passed: its mask may forbid all.
        """
        if not matchers:
            return
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [rows, {self.vocab_size}], got {list(logits.shape)}")
        bitmask = self.allocate_bitmask(len(matchers), pin_memory=logits.is_cuda)
        self.fill_bitmasks(matchers, bitmask)
        apply_bitmask(logits, bitmask, rows)

    @property
    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._num_compiled, self._num_hits, len(self._cache), self.max_cached)

    def _grammar_text(self, spec: StructuredSpec) -> str:
        """llguidance's grammar (a JSON document) for ``spec``."""
        kind, text = spec.key
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=self._json_options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=self._json_options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":  # a JSON string literal is a Lark string literal
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        try:  # Lark as it is, GBNF converted to Lark
            return llguidance.grammar_from("grammar", text)
        except ValueError as e:
            raise ValueError(f"grammar: {e}") from None


def as_spec(structured: StructuredSpec | dict[str, Any]) -> StructuredSpec:
    """A ``StructuredSpec``, or the same from a dict of its fields (``{"json": schema}``, ``{"regex": ...}``)."""
    if isinstance(structured, StructuredSpec):
        return structured
    if isinstance(structured, dict):
        unknown = sorted(set(structured) - set(_KINDS))
        if unknown:
            raise ValueError(f"structured takes {', '.join(_KINDS)}; got {unknown}")
        return StructuredSpec(**structured)
    raise ValueError(f"structured must be a StructuredSpec or a dict of its fields, got {type(structured).__name__}")


class Grammars:
    """An engine's grammar compilers: one per tokenizer (an engine normally sees one), for logits of
    ``vocab_size``. ``matcher`` may be called from any thread."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._compilers: dict[int, tuple[Any, GrammarCompiler]] = {}  # id(tokenizer) -> (it, its compiler)
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredSpec, tokenizer: Any, eos_token_ids: Sequence[int]) -> Matcher:
        """A fresh matcher of ``spec``; ValueError if it can't be compiled."""
        with self._lock:
            entry = self._compilers.get(id(tokenizer))
            if entry is None or entry[0] is not tokenizer:
                compiler = GrammarCompiler(tokenizer, self.vocab_size, eos_token_ids=sorted(eos_token_ids) or None)
                self._compilers[id(tokenizer)] = entry = (tokenizer, compiler)
        return entry[1].matcher(spec)


def by_compiler(
    matchers: Sequence[Matcher], rows: Sequence[int]
) -> list[tuple[GrammarCompiler, list[Matcher], list[int]]]:
    """``matchers`` (and their ``rows``) grouped by their compiler: (compiler, its matchers, their rows)."""
    if matchers and len(rows) == len(matchers) and all(m.compiler is matchers[0].compiler for m in matchers):
        # the usual step: one tokenizer's grammars
        return [(matchers[0].compiler, list(matchers), list(rows))]
    groups: dict[int, tuple[GrammarCompiler, list[Matcher], list[int]]] = {}
    for matcher, row in zip(matchers, rows, strict=True):
        _, ms, rs = groups.setdefault(id(matcher.compiler), (matcher.compiler, [], []))
        ms.append(matcher)
        rs.append(row)
    return list(groups.values())


def mask_rows(logits: torch.Tensor, matchers: Sequence[Matcher], rows: Sequence[int]) -> None:
    """``GrammarCompiler.mask_logits`` for matchers of any compilers (grouped by theirs)."""
    for compiler, ms, rs in by_compiler(matchers, rows):
        compiler.mask_logits(logits, ms, rs)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """``logits[rows[i], t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is 0, in place (an add of -inf: a NaN
    logit stays NaN).

    ``logits``: ``[num_rows, vocab]`` float, any device; ``bitmask``: int32 ``[n, ceil(vocab / 32)]``
    (CPU or ``logits``' device); ``rows``: ``n`` distinct row indices (None: ``n == num_rows``, in order).
    float32 logits on the CPU go through native code (``kernels/cpu_bitmask.py``: one pass, 32 rows of 4,096 in
    0.03 ms) or, without a C compiler, numpy (``apply_bitmask_numpy``); the others through torch
    (``apply_bitmask_torch``).
    """
    n, words = bitmask.shape
    vocab = logits.shape[-1]
    if words * 32 < vocab:
        raise ValueError(f"bitmask covers {words * 32} tokens, logits have {vocab}")
    num_rows = logits.shape[0] if rows is None else len(rows)
    if n != num_rows:
        raise ValueError(f"{n} bitmask rows for {num_rows} logits rows")
    if rows is not None and len(rows) == logits.shape[0] and list(rows) == list(range(n)):
        rows = None  # every row, in order: no gather and scatter
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and bitmask.device.type == "cpu":
        if not cpu_bitmask.apply(logits, bitmask, rows):  # no C compiler, or a layout it does not read
            apply_bitmask_numpy(logits.detach().numpy(), bitmask.numpy(), rows)
    else:
        apply_bitmask_torch(logits, bitmask, rows)


_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)


def apply_bitmask_numpy(logits: np.ndarray, bitmask: np.ndarray, rows: Sequence[int] | None) -> None:
    """``apply_bitmask`` on float32 CPU logits through numpy (where the native loop cannot be built), one thread,
    in place: ``unpackbits`` turns the words into a byte a token (little-endian words: bit ``t % 32`` of word
    ``t // 32`` is byte ``t``), then the bias of ``apply_bitmask_torch`` and its add. 32 rows: 0.09 ms against
    torch's 0.14 at 4,096 tokens, 3.6 against 12 at 128,256 (``python benchmarks/mask_apply_cpu.py``)."""
    vocab = logits.shape[-1]
    words = np.ascontiguousarray(bitmask, dtype="<i4")  # (no copy: the bitmasks made here, on a little-endian host)
    allowed = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")  # [n, vocab] uint8
    bias = np.subtract(allowed, np.float32(1), dtype=np.float32)  # 0 where allowed, -1 where forbidden
    with np.errstate(over="ignore", invalid="ignore"):  # -max * 2 is -inf, and a forbidden +inf NaN, on purpose
        bias *= _FLOAT32_MAX
        bias *= np.float32(2)
        if rows is None:
            np.add(logits, bias, out=logits)
        else:
            logits[np.asarray(rows, dtype=np.intp)] += bias  # distinct rows: one add each


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None) -> None:
    """``apply_bitmask`` in torch ops, on ``logits``' device (on the CPU, one thread: waking torch's sleeping second
    thread for each small op made the application of 32 rows of 4,096 take 0.68 ms instead of 0.11 under
    ``OMP_WAIT_POLICY=PASSIVE`` on 2 cores)."""
    threads = torch.get_num_threads()  # process-wide, as the engine's adaptive threads set it around each forward
    one_thread = logits.device.type == "cpu" and threads > 1
    if one_thread:
        torch.set_num_threads(1)
    try:
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        words = bitmask.to(logits.device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[-1]]  # [n, vocab] int32
        # An additive bias, 0 where allowed and -inf where forbidden: (allowed - 1) * max * 2 overflows to -inf.
        # Plain arithmetic, vectorised: torch's CPU masked_fill_ took 0.2-0.47 ms on [32, 4096] logits (one
        # thread), and so did where (log, the other way to -inf, 1.2 ms); the bias and its add 0.11-0.15 ms in all.
        bias = allowed.to(logits.dtype).sub_(1).mul_(torch.finfo(logits.dtype).max).mul_(2)
        if rows is None:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.as_tensor(rows, dtype=torch.long, device=logits.device), bias)
    finally:
        if one_thread:
            torch.set_num_threads(threads)


def _is_set(spec: StructuredSpec, kind: str) -> bool:
    return spec.json_object is not False if kind == "json_object" else getattr(spec, kind) is not None


def _check_bitmask(bitmask: torch.Tensor, num_rows: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} {list(bitmask.shape)} "
                         f"on {bitmask.device}")  # fmt: skip
    if not bitmask.is_contiguous() or bitmask.shape[0] < num_rows:
        raise ValueError(f"bitmask must be contiguous with at least {num_rows} rows, got {list(bitmask.shape)}")
