"""Constrained decoding for the server: what a response_format or a forced tool call lets the
model write, as a grammar (llguidance, the engine llama.cpp uses), and the per-request
`Constraint` the loop consults token by token (runtime/loop.py).

A grammar is Lark text with llguidance's `%json{...}` (a JSON schema) inside, built here from
the request: the answer's schema, or the chosen tools' calls in the model's own format
(serve/formats.py), after an optional reasoning block the model may write first. Every
grammar is compiled before the request is queued: a schema the engine cannot compile is the
request's 400, naming the engine's message; a grammar is bounded in size like every other input.

Why llguidance: no dependencies (a Rust wheel), a tokenizer built from the artifact's
tokenizer.json, and ~10 us per token mask on the demo pair's vocabulary (bench/constrained.py).
"""

from __future__ import annotations

import json
import re
import threading

import numpy as np

from ..runtime.lazy import lazy_import
from .formats import CALL, Format

llg = lazy_import("llguidance")  # the serve extra; imported on the first constrained request

MAX_GRAMMAR_CHARS = 1 << 16  # a request's grammar (its schemas included), in characters


class GrammarError(ValueError):
    """A grammar the engine refuses (the request's 400)."""


class Grammars:
    """The engine's grammar compiler: llguidance's tokenizer of this artifact (built once, on the
    first constrained request: ~50 ms for a 4k vocabulary, ~1 s for 150k) and compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.hf, self.vocab_size, self.eos = tokenizer, vocab_size, tuple(eos_ids)
        self._tok, self._lock = None, threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                n = max(self.vocab_size, self.hf.get_vocab_size(with_added_tokens=True))
                eos = self.eos[0] if self.eos else None
                try:
                    self._tok = llg.LLTokenizer(self.hf.to_str(), n_vocab=n, eos_token=eos)
                except ValueError:  # a decoder llguidance does not read: the tokens' own text instead
                    self._tok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(self.hf, n, eos)), n_vocab=n)
            return self._tok

    def compile(self, lark: str) -> str:
        """The grammar, checked: GrammarError with the engine's message when it cannot be compiled."""
        if len(lark) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar is {len(lark)} characters (schemas included); this server compiles at "
                               f"most {MAX_GRAMMAR_CHARS}: send a smaller schema or fewer tools")
        grammar = llg.LLMatcher.grammar_from_lark(lark)
        err = llg.LLMatcher.validate_grammar(grammar, self.tokenizer())
        if err and not err.startswith("WARNING"):
            raise GrammarError(_message(err))
        return grammar

    def constraint(self, grammar: str, stop_ids: tuple[int, ...]) -> Constraint:
        matcher = llg.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_message(matcher.get_error()))
        return Constraint(matcher, self.vocab_size, (self.tokenizer().vocab_size + 31) // 32, stop_ids)


class _Vocab:
    """What llguidance's TokenizerWrapper reads of a tokenizer: each token's bytes (its decoded text),
    the special tokens, eos, and an encoder."""

    def __init__(self, hf, n: int, eos: int | None):
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self.eos_token_id, self.bos_token_id, self.special_token_ids = eos, None, sorted(special)
        vocab = hf.get_vocab_size()
        # a special token is its name after a 0xFF byte (llguidance's mark: Lark's <|name|> matches it)
        self.tokens = [b"" if i >= vocab else b"\xff" + hf.id_to_token(i).encode() if i in special else
                       hf.decode([i], skip_special_tokens=False).encode() for i in range(n)]
        self.hf = hf

    def __call__(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids


class Constraint:
    """One request's grammar state, for the loop (runtime/loop.py `Request.constraint`): which tokens
    may come next (`allowed`, `accepts`), the token that came (`consume`), and `rollback` (the drafts
    consumed while drafting under the mask). A stop token may come where the grammar is complete."""

    def __init__(self, matcher, vocab_size: int, words: int, stop_ids: tuple[int, ...]):
        self.m, self.V, self.stop = matcher, vocab_size, np.asarray(sorted(set(stop_ids)), np.int64)
        self._bits = np.zeros(words, np.int32)  # llguidance's bitmask: a bit per token of its tokenizer
        self.masks = 0  # full masks computed (the bench's count)

    def accepts(self, token: int) -> bool:
        if token in self.stop:
            return self.m.is_accepting()
        return self.m.validate_tokens([token]) == 1

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next (stop tokens where it is complete; never none)."""
        self.masks += 1
        n = len(self._bits) * 4
        self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, n)
        ok = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.V].astype(bool)
        ok[self.stop[self.stop < self.V]] = self.m.is_accepting() or not ok.any()
        return ok

    def consume(self, token: int) -> None:
        if token in self.stop:
            return
        if not self.m.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.m.get_error()[:200]}")

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens (the loop's drafting under the mask; stop tokens are never consumed)."""
        if n and not self.m.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self.m.get_error()[:200]}")


def _message(err: str) -> str:
    """The engine's first line, without its position in our Lark text (the client never sees that text)."""
    line = err.strip().splitlines()[0] if err.strip() else "the grammar does not compile"
    return re.sub(r"^at \d+\(\d+\): ", "", line)[:300]


# -- grammars from a request -------------------------------------------------------------------------


def _prefix(fmt: Format, thinking: bool) -> str:
    """Where the constrained part starts (Lark rules): at once, or, where the prompt opened a think
    block (Qwen3.5's templates, a thinking model's), after the reasoning and its closing marker. A
    model that opens the block itself (Qwen3 with enable_thinking) answers without it under a constraint:
    an optional block would let an unsure model reason until max_tokens."""
    if fmt.think is None or not thinking:
        return 'start: body\n'
    close = fmt.think[1]
    return (f'start: think_text WS body\nthink_text[stop={json.dumps(close)}]: /(.|\\n)*/\n'
            'WS: /[ \\t\\r\\n]*/\n')


def grammar(fmt: Format, thinking: bool, tools: list[dict] | None, parallel: bool, answer: dict | None) -> str:
    """What the model may write: one call (`parallel`: one or more) of one of `tools` ({"name",
    "parameters"}) in the model's own format, or an answer that is a JSON value of the schema `answer`
    (json_object: {"type": "object"}), or either where both are given (after the reasoning where the
    prompt opened a think block)."""
    if fmt.name == "harmony":
        alts = [f'"{t["name"]}" " " <|constrain|> "json" <|message|> ' + _json(_params(t)) for t in tools or []]
        body = ([f'"commentary to=functions." ({" | ".join(alts)})'] if alts else []) + \
            ([f'"final" <|message|> {_json(answer)}'] if answer is not None else [])
        return f'start: <|channel|> ({" | ".join(body)})\n'
    rules, alts = [], []
    if tools:
        alts.append('call ("\\n" call)*' if parallel else "call")
        rules.append("call: " + _call(fmt, tools, rules))
    if answer is not None:
        alts.append(_json(answer))
    if fmt.name == "llama3_json":  # no reasoning; a call is the whole answer
        return f'start: {" | ".join(alts)}\n' + "".join(r + "\n" for r in rules)
    return _prefix(fmt, thinking) + f'body: {" | ".join(alts)}\n' + "".join(r + "\n" for r in rules)


def _call(fmt: Format, tools: list[dict], rules: list[str]) -> str:
    """One call of one of `tools` in the model's format (its helper rules appended to `rules`)."""
    if fmt.name == "qwen3_coder":
        names = []
        for i, t in enumerate(tools):
            params = " ".join(_xml_param(p, t) for p in _params(t).get("properties", {}))
            head = _lit("<function=" + t["name"] + ">\n")
            rules.append(f'f{i}: {head} {params} "</function>"')
            names.append(f"f{i}")
        rules.append('value[stop="\\n</parameter>"]: /(.|\\n)*/')
        return f'"{CALL[0]}\\n" ({" | ".join(names)}) "\\n{CALL[1]}"'
    key = "parameters" if fmt.name == "llama3_json" else "arguments"
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, key: _params(t)},
                         "required": ["name", key], "additionalProperties": False} for t in tools]}
    if fmt.name == "llama3_json":
        return _json(schema)
    return f'"{CALL[0]}\\n" {_json(schema)} "\\n{CALL[1]}"'


def _params(t: dict) -> dict:
    return t.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}  # no arguments


# JSON as json.dumps and the chat templates' tojson write it (", " and ": ", no other whitespace): the
# model's own habit, and a bounded schema then bounds the output
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: dict) -> str:
    """A JSON schema as a Lark rule body."""
    return "%json " + json.dumps({**schema, "x-guidance": {**COMPACT, **(schema.get("x-guidance") or {})}})


def _lit(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _xml_param(name: str, t: dict) -> str:
    """One parameter of Qwen3-Coder's call: optional unless required (in the schema's order)."""
    part = _lit("<parameter=" + name + ">\n") + ' value "\\n"'
    return part if name in (_params(t).get("required") or []) else f"({part})?"
