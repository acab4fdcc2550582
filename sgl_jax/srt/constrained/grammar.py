"""What a request's constraint is, compiled to a grammar llguidance's matcher takes.

A constraint is a (kind, text) pair: ``json_schema`` (a JSON schema, as text), ``regex``,
``ebnf`` (GBNF, ``root ::= ...`` as SGLang's; Lark syntax is taken too) or ``lark`` (the
grammars this server writes itself, e.g. for ``tool_choice``). ``GrammarCompiler.compile``
turns it into llguidance's grammar text and validates it against the served tokenizer, under
size and work limits; a constraint that does not compile is a ``ValueError`` with the
library's message (the HTTP layer answers 400). Results are kept in an LRU keyed by
(kind, text), so a client that sends the same schema on every request compiles it once.

Runs in the tokenizer manager's worker threads (never on the event loop); the scheduler only
builds matchers from the already-validated grammar text (``constrained.matchers``).

Why llguidance: a Rust library with a small Python binding and no torch dependency (xgrammar,
SGLang's default, needs torch); sglang-jax uses it too. Its masks are computed lazily per
step (no ahead-of-time compilation of the whole token automaton), in well under a millisecond
per row for typical JSON schemas.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from sgl_jax.srt.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # the request fields, at most one per request
LARK = "lark"  # grammars written by the server itself
MAX_GRAMMAR_CHARS = 64 * 1024  # longest constraint text a request may send
CACHE_SIZE = 256  # compiled grammars kept (LRU)


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's work limits, for validation and for every matcher: a grammar that needs
    more is refused at validation, and a step that would need more ends the request with the
    matcher's error, instead of stalling the scheduler. Fuel: ~50k/ms at build, ~14k/ms per
    mask (llguidance's figures), so a build is bounded at ~20 ms and a mask at ~7 ms."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000, step_lexer_fuel=100_000, step_max_items=50_000,
        max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=True)


def llg_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """The served tokenizer as llguidance's, over the model's ``vocab_size`` ids (a model
    vocabulary padded past the tokenizer's has ids no text maps to: never allowed)."""
    n_vocab = max(vocab_size, len(tokenizer))
    return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=n_vocab,
                                  eos_token=sorted(set(eos_ids)) or None)


class GrammarCompiler:
    """(kind, text) -> validated llguidance grammar text, cached; thread-safe."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, any_whitespace: bool = True,
                 cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.any_whitespace = any_whitespace
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], str | ValueError] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str, field: str | None = None) -> str:
        """The grammar for ``text`` of ``kind``; ValueError naming ``field`` (default: the
        kind) when it does not compile, is too large or needs more work than the limits."""
        field = field or kind
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{field} has {len(text)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are accepted")
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._build(kind, text)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, ValueError):
            raise ValueError(f"{field} does not compile: {hit}")
        return hit

    def _build(self, kind: str, text: str) -> str | ValueError:
        """The grammar, or the error to raise (errors are cached too: a client that resends a
        bad schema costs one compilation)."""
        try:
            grammar = self._grammar(kind, text)
        except (ValueError, GbnfToLarkError) as e:
            return ValueError(str(e))
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer,
                                                      limits=parser_limits())
        return ValueError(error.strip()) if error else grammar

    def _grammar(self, kind: str, text: str) -> str:
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object (or true / false)")
            options = {"whitespace_flexible": self.any_whitespace}
            if not self.any_whitespace:  # compact: no spaces after ',' and ':' either
                options.update(item_separator=",", key_separator=":")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "ebnf":
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
        if kind == LARK:
            return llguidance.LLMatcher.grammar_from_lark(text)
        raise ValueError(f"unknown grammar kind {kind!r}; one of {(*GRAMMAR_KINDS, LARK)}")


def json_object_schema() -> str:
    """``response_format: {"type": "json_object"}``: any JSON object."""
    return json.dumps({"type": "object"})


def compiler_for(backend: str, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int],
                 any_whitespace: bool) -> GrammarCompiler | None:
    """The tokenizer manager's compiler (None with ``--grammar-backend none``)."""
    if backend == "none":
        return None
    return GrammarCompiler(llg_tokenizer(tokenizer, vocab_size, eos_ids), any_whitespace)


def request_grammar(compiler: GrammarCompiler | None, constraint: tuple[str, str] | None,
                    speculative_algorithm: str | None, field: str | None = None) -> str | None:
    """The validated grammar of a request's ``constraint`` ((kind, text) or None); a
    ValueError naming ``field`` (default: the kind) when the server cannot honour it."""
    if constraint is None:
        return None
    field = field or constraint[0]
    if compiler is None:
        raise ValueError(f"{field}: constrained decoding is off on this server "
                         "(--grammar-backend none)")
    if speculative_algorithm:
        raise ValueError(f"{field}: constrained decoding does not run with speculative "
                         f"decoding (--speculative-algorithm {speculative_algorithm}); send "
                         "the request to a server without it")
    return compiler.compile(*constraint, field)
