"""Host caches of a batched ONNX Runtime backend: which exports and providers can run rows,
per-row writes into position-major caches, a row's gather, and the drafter's context ring.

The ring (Manifest.draft_ring): drafters whose layers all slide.

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

from .. import contract as C, manifest as M
from ..errors import DFlashError


def check_batch(m: M.Manifest, max_batch: int, device: str, directory) -> int:
    """max_batch, or one line on why this export or provider cannot run that many rows."""
    if max_batch < 1:
        raise DFlashError(f"--batch must be at least 1 (got {max_batch})")
    if max_batch > 1 and not C.ragged(m):
        raise DFlashError(f"{directory} was exported before batched decoding (batch 1 only); re-export it with this "
                          "dflash-export to run --batch > 1")
    if C.ring(m) and device != "cpu":
        raise DFlashError("a drafter context ring runs on the CPU provider in this version (its cache is a host "
                          "array); use --provider cpu")
    if max_batch > 1 and device != "cpu":
        raise DFlashError("--batch > 1 runs on ONNX Runtime's CPU provider (its batched caches are host arrays, written "
                          "per row between calls); on an NVIDIA GPU use --backend trt with engines from `dflash-export "
                          "build OUT --max-batch N`, or --provider cpu, or --batch 1")
    return max_batch


def scatter(cache: np.ndarray, new: np.ndarray, rows, lengths: np.ndarray, s: int, counts) -> None:
    """Write each row's new positions ([layers, R, s, ...] in `new`) into the position-major
    cache [layers, max_len, B, ...] at that row's own length: counts[r] of them."""
    L, n = cache.shape[0], cache.shape[1]
    view = new[:, : len(rows) * s * int(np.prod(cache.shape[3:]))].reshape(L, len(rows), s, *cache.shape[3:])
    for r, b in enumerate(rows):
        at = int(lengths[b])
        w = min(int(counts[r]), n - at)
        cache[:, at : at + w, b] = view[:, r, :w]


def gather_row(cache: np.ndarray, out: np.ndarray, b: int, p: int) -> None:
    """Row b's first p positions of every layer, contiguous in out [layers, p, 1, ...]."""
    out[:, : p * int(np.prod(cache.shape[3:]))].reshape(cache.shape[0], p, *cache.shape[3:])[:] = cache[:, :p, b]


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
