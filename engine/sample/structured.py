"""Structured outputs: what a request constrains its output to (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark or GBNF grammar: vLLM's StructuredOutputsParams) and its compilation into a grammar.

The grammar library is llguidance (1.9), chosen over xgrammar (0.2.9) by measurement on CPU with torch 2.13
(bench/grammar_libs.py; bench/results/grammar-libs-cpu.json on the demo tokenizer, 8,192 tokens, and
grammar-libs-131k-cpu.json on a 131k-token BPE standing in for Qwen2.5 / Llama 3.1): a new JSON schema compiles in
0.3-1 ms against xgrammar's 5-10 ms (8k) and 120-130 ms (131k), a pause in the request path for every new schema or
tool list; the 64 masks of a step, at different positions, fill in 1.1-3.8 ms against 5.0-5.4 ms at 131k (on 8k
xgrammar is faster, 0.07 against 0.6 ms: both far below a CPU forward). llguidance ships one abi3 wheel of about
3 MB per platform (Linux x86_64/aarch64, macOS, Windows) for every Python >= 3.9 with no dependencies; xgrammar a wheel
per Python version plus apache-tvm-ffi, and it requires torch, transformers and triton. Both ran on this CPU with
torch 2.13. llguidance's Lark grammars embed JSON schemas (%json), which is what tool-call formats (text around
JSON) need. The masks are applied by structured_mask.apply_bitmask (neither library's apply: xgrammar's takes 4 ms
for 64 x 8k on CPU, llguidance's is torch.compile'd).
"""
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from quant_serve.engine.sample.structured_limits import DEFAULT_LIMITS, StructuredLimits, check_schema, short

# JSON without free whitespace: one space after ',' and ':' as Python's json.dumps writes it. A small model allowed
# any whitespace can spend its whole budget on newlines; whitespace_pattern lets a request allow more.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "regex", "choice", "grammar", "json_object")
GRAMMAR_CACHE_SIZE = 256          # compiled grammars kept (tool lists and schemas repeat across requests)
SLOW_CACHE_SIZE = 256             # constraints whose compilation went over the budget: refused at once when sent again


def close_objects(schema):
    """A copy of the JSON schema in which objects that list properties allow no others unless they say so
    (additionalProperties false, what xgrammar's strict mode and OpenAI's strict schemas do): a model free to add
    keys can go on adding them until it runs out of tokens. allOf branches stay open (closing them would refuse the
    keys of the other branches)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    for key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "not", "if", "then", "else",
                "contains", "additionalItems"):
        if key in out:
            out[key] = close_objects(out[key])
    return out


class StructuredOutputsUnavailable(ValueError):
    """The grammar library is not installed on this platform."""


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names). json: a JSON schema (dict or its text); regex: Rust regex syntax;
    choice: the output is one of these strings; grammar: Lark (llguidance's dialect) or GBNF (llama.cpp) text;
    json_object: any JSON object. whitespace_pattern: a regex for the whitespace JSON may hold (default none).
    Objects of a schema that list their properties take no others unless additionalProperties says so."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The constraint as canonical text: equal keys compile to the same grammar."""
        return json.dumps([self.kind, getattr(self, self.kind), self.whitespace_pattern], sort_keys=True)

    @classmethod
    def from_value(cls, value: "StructuredOutputsParams | dict[str, Any] | None") -> "StructuredOutputsParams | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        unknown = set(value) - set(KINDS) - {"whitespace_pattern"}
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {', '.join(sorted(unknown))}")
        return cls(**value)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:
        raise StructuredOutputsUnavailable(
            "structured outputs need the llguidance package, which is not installed here (pip install llguidance)"
        ) from e
    return llguidance


def grammar_text(params: StructuredOutputsParams, limits: StructuredLimits = DEFAULT_LIMITS) -> str:
    """The llguidance grammar of a constraint (not yet checked: GrammarCompiler.compile does that); ValueError for
    a constraint past our limits (structured_limits.py)."""
    llg = _llguidance()
    kind, value = params.kind, getattr(params, params.kind)
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        if isinstance(schema, str):
            if len(schema) > limits.max_schema_chars:
                raise ValueError(f"the JSON schema is {len(schema)} characters long; the limit is "
                                 f"{limits.max_schema_chars}")
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:     # a number of 5,000 digits, nesting past the stack
                raise ValueError(f"the JSON schema is not valid JSON: {short(str(e), 200)}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        text = json.dumps(schema) if kind == "json" else ""
        check_schema(schema, limits, len(text))
        schema = close_objects(schema)
        overrides = {"whitespace_pattern": params.whitespace_pattern} if params.whitespace_pattern else None
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT, overrides=overrides)
    if kind == "regex":
        _check_length("regex", value, limits.max_regex_chars)
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if len(value) > limits.max_choices:
            raise ValueError(f"the choice has {len(value)} items; the limit is {limits.max_choices}")
        _check_length("choice", "".join(value), limits.max_choice_chars)
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    _check_length("grammar", value, limits.max_grammar_chars)
    return llg.grammar_from("grammar", value)          # Lark as is, GBNF converted to Lark


def _check_length(what: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise ValueError(f"the {what} is {len(text)} characters long; the limit is {limit}")


class GrammarCompiler:
    """The llguidance view of the engine's tokenizer (built on first use: about 1 s for a 150k vocabulary) and the
    compiled grammars, cached by constraint. Thread-safe: the server compiles in its request threads (to answer 400
    before queueing), the engine thread builds the matchers.

    A compilation runs in this compiler's own threads with a wall-clock budget (limits.compile_budget_s): past it
    the caller gets a ValueError at once, and the compilation still ends by itself, bounded by llguidance's fuel
    limits (its Rust code cannot be interrupted); the constraint is then refused at once when it comes again."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 limits: StructuredLimits = DEFAULT_LIMITS):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        # an EOS the tokenizer itself does not know (a dummy-weight model on another tokenizer, as the benches run)
        # is no EOS the grammar library can take: the tokenizer's own then
        known = min(vocab_size, len(tokenizer))
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < known] or \
            ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self._tokenizer_lock = threading.Lock()
        self._tokenizer = None
        self._cache_lock = threading.Lock()
        self._grammars: OrderedDict[str, tuple] = OrderedDict()    # constraint key -> (grammar, matcher), LRU
        self._slow: OrderedDict[str, None] = OrderedDict()         # keys whose compilation went over the budget
        # llguidance releases the GIL while it compiles: two threads, so one slow schema does not hold up the rest
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")

    @property
    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                if not self.eos_token_ids:
                    raise StructuredOutputsUnavailable("structured outputs need the model's EOS token, and neither "
                                                       "its config nor its tokenizer names one")
                llg = _llguidance()
                try:        # one EOS: llguidance < 1.7 (the last with wheels for glibc < 2.31) takes no list
                    self._tokenizer = llg.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                            eos_token=self.eos_token_ids[0])
                except ValueError as e:      # a slow (Python) tokenizer, say
                    raise StructuredOutputsUnavailable(f"structured outputs cannot use this tokenizer (a fast "
                                                       f"tokenizer is needed): {e}") from e
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar; ValueError naming what is wrong with the constraint (errors are not cached)."""
        return self._compiled(params)[0]

    def _compiled(self, params: StructuredOutputsParams):
        """(grammar, a matcher at its start). The matcher is built here, in the caller's thread (the server's
        request threads), and copied for each sequence: a copy takes ~0.1 ms where building one takes ~1 ms, and
        far more for large grammars, in the engine thread."""
        key = params.key()
        with self._cache_lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
            slow = key in self._slow
        budget = self.limits.compile_budget_s
        if slow:
            raise ValueError(f"compiling it took longer than the server's budget of {budget:g} s")
        tokenizer = self.tokenizer          # built outside the budget: once per server, not per constraint
        grammar = grammar_text(params, self.limits)
        future = self._executor.submit(self._build, grammar, tokenizer)
        try:
            matcher = future.result(timeout=budget)
        except FutureTimeout:
            with self._cache_lock:
                self._slow[key] = None
                if len(self._slow) > SLOW_CACHE_SIZE:
                    self._slow.popitem(last=False)
            raise ValueError(f"compiling it took longer than the server's budget of {budget:g} s") from None
        except ValueError as e:
            raise ValueError(f"the {params.kind.replace('_', ' ')} constraint cannot be compiled: {e}") from None
        with self._cache_lock:
            self._grammars[key] = (grammar, matcher)
            if len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar, matcher

    def _build(self, grammar: str, tokenizer):
        """A matcher at the start of the grammar, checked: the library validates it, then the probe follows it from
        the start for as long as it forces one token (limits.probe_steps at most), computing each mask, so that a
        grammar that fails on its first tokens (a row too wide after a common prefix, a lexer past its fuel, a $ref
        loop with nothing to match) is refused here rather than failing a request after it was accepted."""
        llg = _llguidance()
        limits = self.limits.parser_limits()
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        matcher = None if error else llg.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        error = error or matcher.get_error() or self._probe(matcher.deep_copy())
        if error:
            raise ValueError(short(error))
        return matcher

    def _probe(self, matcher) -> str:
        """Follows the forced tokens from the start (on a copy); the first error met, or ""."""
        eos = self.eos_token_ids[0]
        for _ in range(self.limits.probe_steps):
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            if matcher.is_error():
                return matcher.get_error()
            allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[:self.vocab_size])
            if len(allowed) == 0:
                return "the grammar allows no token at its start"
            if len(allowed) != 1 or allowed[0] == eos or matcher.is_stopped():
                return ""
            if not matcher.consume_token(int(allowed[0])):
                return matcher.get_error() or "the grammar refused the one token it allowed"
        return ""

    def matcher(self, params: StructuredOutputsParams):
        """A matcher at the start of the constraint, for one sequence (the cached one is never advanced)."""
        return self._compiled(params)[1].deep_copy()
