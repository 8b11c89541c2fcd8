"""The sliding layers' rings of a gpt-oss / Gemma 4 target, host side (numpy).

A sliding layer's query sees its last `window` positions only, so each row keeps `ring`
(= window) slots per such layer, position t in slot t mod ring: memory flat in the context
(contract.WINDOW_KV; docs/windowed.md measures it). A target call writes its new positions'
K/V into a scratch (`flat`, viewed [rows, seq, ...]) and only `commit_rows` writes the kept
ones into their slots: a rejected draft never overwrites a position the window still needs,
so rollback stays "commit fewer". The graph reads a slot's position from the row's length.
"""

from __future__ import annotations

import numpy as np

from . import contract as C, manifest as M
from .names import layer_names
from .shared import STORAGE


class WindowRings:
    """Per sliding layer, K and V rings [max_batch, ring, Hkv, D] and the call's scratch, by contract name."""

    def __init__(self, m: M.Manifest, max_chunk: int, max_batch: int = 1):
        kinds = C.layer_kinds(C.TARGET, m)
        self.layers = [i for i, k in enumerate(kinds) if k == C.SLIDING]
        self.ring = int(C.window(m)["ring"])
        self.names = layer_names(m.target_layers)
        self.changed = True  # the rings moved since a device copy was last made of them (as LinearStates)
        dtype = STORAGE[C.dtype(C.WINDOW_KV[0], m)]
        self.buf, self.flat, self.rows_seq = {}, {}, (1, max_chunk)
        for i in self.layers:
            for past, new in ((self.names.past_key[i], self.names.new_key[i]),
                              (self.names.past_value[i], self.names.new_value[i])):
                self.buf[past] = np.zeros(C.shape(C.WINDOW_KV[0], m, batch=max_batch, window_past=self.ring), dtype)
                self.flat[new] = np.zeros(int(np.prod(C.shape(C.WINDOW_NEW[0], m, batch=max_batch, seq=max_chunk))), dtype)

    def layout(self, rows: int, seq: int) -> None:
        """The next call writes [rows, seq, ...] new positions (see `view`)."""
        self.rows_seq = (rows, seq)

    def view(self, name: str) -> np.ndarray:
        """The last call's new K or V of `name` (new_key.i / new_value.i), [rows, seq, Hkv, D]."""
        r, s = self.rows_seq
        tail = next(iter(self.buf.values())).shape[2:]
        return self.flat[name][: r * s * int(np.prod(tail))].reshape(r, s, *tail)

    def bound(self, length: int) -> int:
        """Slots one row of `length` positions binds: its written ones (all, once the ring is full)."""
        return min(int(length), self.ring)

    def commit_rows(self, rows, n, lengths: np.ndarray) -> None:
        """Row rows[r] keeps the first n[r] new positions of the last call's row r, written at
        their slots from its length (before the commit) on; only a long chunk's last `ring` land."""
        self.changed = self.changed or any(n)
        R = self.ring
        for i in self.layers:
            for past, new in ((self.names.past_key[i], self.names.new_key[i]),
                              (self.names.past_value[i], self.names.new_value[i])):
                ring, fresh = self.buf[past], self.view(new)
                for r, (b, k) in enumerate(zip(rows, n)):
                    at = int(lengths[b])
                    pos = np.arange(max(at, at + int(k) - R), at + int(k))
                    ring[b, pos % R] = fresh[r, pos - at]

    def move(self, src: int, dst: int) -> None:
        """Row src's rings to row dst (a batch's rows stay in its first slots)."""
        self.changed = True
        for ring in self.buf.values():
            ring[dst] = ring[src]

    def nbytes(self) -> int:
        """Bytes of the rings (flat in the context) and of the per-call scratch."""
        return sum(a.nbytes for a in self.buf.values()) + sum(a.nbytes for a in self.flat.values())
