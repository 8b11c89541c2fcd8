"""Prompt-prefix reuse for the batched loop: finished rows' caches kept for the next prompts.

A row of a batched backend lives in whichever slot the loop gives it, and its slot goes to
the next request as soon as it leaves (runtime/loop.py keeps the running rows in slots
0..width-1). So the sequences worth keeping are copied out when their row leaves (`park`:
the valid prefix of the target's K/V and of the drafter's context, one row, once) and
copied into the slot of a later request whose prompt starts with them (`restore`), which
then prefills only the rest: llama.cpp's `cache_prompt` without a slot per sequence. The
copies are the row's own K/V, bit for bit, so reuse is lossless exactly as a slot's is.

`PrefixCache.hook(prompt, speculative)` gives the loop's `Request.prefix`: how many prompt
tokens it restores (`reuse`), `restore(slot)` at its join and `park(slot, tokens)` at its
leave. The cache holds at most `entries` sequences and `budget` bytes (least recently used
out first); a parked sequence that extends a kept one replaces it (a multi-turn chat keeps
one entry). Hybrid targets (a recurrent state per row) and one-row backends are not served
here: one-row backends keep their caches in place (`Backend.keep`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import contract as C


@dataclass
class Parked:
    tokens: list[int]  # the sequence whose K/V `kv` holds, by position
    kv: np.ndarray  # the target's attention K/V of those positions, one row (layout: the backend's save_row)
    ctx: np.ndarray | None  # the drafter's context K/V of its first `ctx_len` positions
    ctx_len: int

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (0 if self.ctx is None else self.ctx.nbytes)


def supported(backend) -> bool:
    """Whether the backend's rows can be parked (`Backend.parks_rows`: ONNX Runtime rows of
    attention caches, no recurrent states or sliding rings), the drafter's context not a ring
    (a ring holds only its latest positions, not a prefix to keep: the rule `Backend.reusable`
    applies to one row)."""
    return (backend.parks_rows and backend.states is None and backend.rings is None
            and not C.ring(backend.manifest))


def save_row(backend, b: int, tokens: list[int]) -> Parked:
    """Copy row b's valid caches out (the tokens they hold: `tokens[:lengths[b]]`)."""
    p, pc = int(backend.lengths[b]), int(backend.ctx_lengths[b])
    kv, ctx = backend.save_row(b)
    return Parked(list(tokens[:p]), kv, ctx, pc if ctx is not None else 0)


def load_row(backend, b: int, parked: Parked, n: int, ctx_n: int) -> None:
    """Slot b holds the first n target and ctx_n drafter positions of `parked`, nothing else."""
    backend.load_row(b, parked.kv, parked.ctx, n, ctx_n)


def common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """Parked sequences of one batched backend; see the module docstring."""

    def __init__(self, backend, entries: int, budget: int):
        self.backend, self.entries, self.budget = backend, entries, budget
        self.kept: list[Parked] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.kept)

    def hook(self, prompt: list[int], speculative: bool, use: bool = True) -> "Hook":
        """The loop's hook for a request: restores the longest kept prefix of `prompt` (at most
        all but its last token; a speculative row also needs it in the drafter's context)."""
        best, n = None, 0
        for e in self.kept if use else ():
            k = min(common(e.tokens, prompt), len(prompt) - 1)
            k = min(k, e.ctx_len) if speculative else k
            if k > n:
                best, n = e, k
        if best is not None:  # most recently used last
            self.kept.remove(best)
            self.kept.append(best)
        return Hook(self, best, n, speculative)

    def park(self, b: int, tokens: list[int]) -> None:
        if not self.entries or int(self.backend.lengths[b]) == 0:
            return
        e = save_row(self.backend, b, tokens)
        self.kept = [k for k in self.kept if common(k.tokens, e.tokens) < len(k.tokens)]  # e extends them: gone
        self.kept.append(e)
        while self.kept and (len(self.kept) > self.entries or self.nbytes > self.budget):
            self.kept.pop(0)


@dataclass
class Hook:
    """`Request.prefix` of one request (runtime/loop.py calls restore at its join, park at its leave)."""

    cache: PrefixCache
    entry: Parked | None
    reuse: int
    speculative: bool

    def restore(self, slot: int) -> None:
        if self.entry is None:
            self.cache.backend.reset_row(slot)
            return
        ctx_n = self.reuse if self.speculative else min(self.reuse, self.entry.ctx_len)
        load_row(self.cache.backend, slot, self.entry, self.reuse, ctx_n)

    def park(self, slot: int, tokens: list[int]) -> None:
        self.cache.park(slot, tokens)
