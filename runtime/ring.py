"""The drafter's context cache as a ring (Manifest.draft_ring): drafters whose layers all slide.

No block query sees further back than the window, so the cache keeps `ring` slots per layer
and row, position t in slot t mod ring: memory and the draft_block call stop growing with
the context. The graph finds each slot's position from the row's context length alone (the
newest position congruent to the slot, models/drafter.py `block_mask`), since a row's context
is always appended in order. Rollback is unchanged (only the target's verify positions are
discarded; the context gets accepted positions only), but keeping a shorter prefix of the
context (prompt reuse) is not possible once later positions have overwritten its slots.
"""

from __future__ import annotations

import numpy as np


def ring_scatter(layers: list[np.ndarray], new: np.ndarray, rows, lengths: np.ndarray, s: int, counts,
                 ring: int) -> None:
    """Write each row's new context K/V (`new` [layers, R*s*...], row r's first counts[r] of s
    positions) into the ring caches (`layers`: per layer [ring, B, Hkv, D], or a one-row
    backend's [1, ring, Hkv, D], the same memory) at their slots, the row's positions starting
    at lengths[b]. Only the last `ring` positions of a long chunk land."""
    tail = layers[0].shape[-2:]
    layers = [x.reshape(ring, -1, *tail) for x in layers]
    view = new[:, : len(rows) * s * int(np.prod(tail))].reshape(len(layers), len(rows), s, *tail)
    for r, b in enumerate(rows):
        at, n = int(lengths[b]), int(counts[r])
        pos = np.arange(max(at, at + n - ring), at + n)
        for j, cache in enumerate(layers):
            cache[pos % ring, b] = view[j, r, pos - at]
