"""OpenAI's two shapes of log-probabilities, from the loop's record (runtime/logprobs.py).

Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
one entry per token; `top_logprobs[i]` maps token text to log-probability for the `logprobs`
most likely tokens plus the chosen one (vLLM's and OpenAI's rule: up to logprobs + 1
entries); with `echo` the prompt's tokens come first, the first with `null` (nothing scores it).
Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}`.

A token's text is what it adds to the decoded text in context (so the pieces join into the
response's text and `text_offset` indexes it); a token that adds nothing there (a special
token the text skips) shows its own decoding, and one that ends inside a character U+FFFD.
"""

from __future__ import annotations

import os

from ..runtime.logprobs import TokenLogprob

WINDOW = 6  # tokens of context a piece is decoded in (enough for merges and split characters)


class Pieces:
    """Token texts for one tokenizer (`text`: serve/text.py Text)."""

    def __init__(self, text):
        self.text, self.own = text, {}

    def token(self, t: int) -> str:
        """A token's own text (special tokens included), cached."""
        s = self.own.get(t)
        if s is None:
            s = self.own[t] = self.text.tokenizer.decode([t], skip_special_tokens=False)
        return s

    def pieces(self, ids: list[int], before: list[int] = ()) -> list[str]:
        """What each of `ids` adds to the decoded text after `before` (the tokens preceding them)."""
        ctx, out = list(before[-WINDOW:]), []
        prev = self.text.decode(ctx)
        for t in ids:
            ctx.append(t)
            cur = self.text.decode(ctx)
            out.append(cur[len(os.path.commonprefix([prev, cur])):])
            if len(ctx) > WINDOW:
                ctx = ctx[-WINDOW:]
                cur = self.text.decode(ctx)
            prev = cur
        return out

    def legacy(self, entries: list[TokenLogprob | None], ids: list[int], before: list[int],
               offset: int) -> tuple[dict, int]:
        """The completions shape for `ids` (their entries; None: no score), their text starting at
        `offset` in the response's; and the offset after them."""
        pieces = self.pieces(ids, before)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, e, p in zip(ids, entries, pieces):
            out["tokens"].append(p or self.token(t))
            out["text_offset"].append(offset)
            offset += len(p)
            out["token_logprobs"].append(None if e is None else e.logprob)
            if e is None:
                out["top_logprobs"].append(None)
                continue
            top = {self.token(i): v for i, v in reversed(e.top)}  # on a text clash the likelier keeps its key
            top.setdefault(self.token(e.token), e.logprob)
            out["top_logprobs"].append(top)
        return out, offset

    def chat(self, entries: list[TokenLogprob], ids: list[int], before: list[int]) -> list[dict]:
        """The chat shape's `content` entries for `ids`."""
        out = []
        for t, e, p in zip(ids, entries, self.pieces(ids, before)):
            s = p or self.token(t)
            out.append({"token": s, "logprob": e.logprob, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": self.token(i), "logprob": v, "bytes": list(self.token(i).encode())}
                                         for i, v in e.top]})
        return out


def merge(a: dict | None, b: dict) -> dict:
    """Two legacy records one after the other (echo's prompt, then the completion)."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
