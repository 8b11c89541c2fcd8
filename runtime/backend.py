"""The backend interface: what a graph runner (ONNX Runtime, TensorRT) must provide.

A backend loads one exported directory (runtime/contract.py), owns the KV buffers and
runs the three graphs. It decides nothing: the loop (runtime/loop.py) picks tokens,
accepts drafts and tells the backend how many positions to keep.

State, all in positions of the one sequence being generated (batch 1):

    target_len    valid positions in the target KV cache (slots [0, target_len))
    context_len   valid positions in the drafter's context KV cache; the loop keeps
                  context_len == target_len before every `draft_block`
    max_len       capacity of both caches (the manifest's max_context)
    max_chunk     most positions one `target` call takes (>= block_size; prefill is
                  cut into chunks of at most this many tokens)
    has_drafter   False when loaded for plain decoding only (draft_* then unavailable)

The buffers are allocated once, at load, sequence-major [1, max_len, Hkv, D] per layer.
Each call sees the valid prefix in place (no copy of the cache, ever) and writes its new
positions into the slots right after it. Positions past a valid length are scratch:
rollback after a rejected draft is `commit(a)` with a smaller `a`, nothing else.

Arrays returned by a backend may be views of its own output buffers: valid until the
next call on that backend. The loop copies what it keeps (it turns them into lists).
Every method returns only when the results are ready on the host (GPU: synchronised),
so the loop can time each call with a wall clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from . import contract as C
from .manifest import Manifest
from .errors import DFlashError, InternalError
from .hybrid import LinearStates


@dataclass
class TargetOut:
    next_ids: np.ndarray  # [S] int64: the target's argmax at each new position (in-graph ArgMax)
    logits: np.ndarray | None  # [S, V] float32, only when asked for (sampling needs them)


@dataclass
class Draft:
    """What one drafter pass proposes for the K-1 masked positions of the block."""

    ids: np.ndarray  # [K-1] int64: the in-graph ArgMax
    conf: np.ndarray | None = None  # [K-1] float32 top-1 probabilities (adaptive verify); None: not exported


class Backend(ABC):
    """Runs target.onnx / draft_context.onnx / draft_block.onnx (or their engines)."""

    manifest: Manifest
    max_len: int
    max_chunk: int
    has_drafter: bool = True
    target_len: int = 0
    context_len: int = 0
    names: C.Names  # every per-layer tensor name, built once at load (contract.names_of)
    _pending: int = 0  # positions written by the last `target` call, not yet committed
    states: LinearStates | None = None  # hybrid targets: the committed DeltaNet states, host side (runtime/hybrid.py)

    # -- the four operations the loop uses ------------------------------------------------

    def target(self, ids: np.ndarray, want_logits: bool = False) -> TargetOut:
        """Run the target over `ids` ([S] int64, S >= 1) at positions target_len .. target_len+S-1.

        Attends to cache slots [0, target_len) plus the new positions (causal). Writes the
        new K/V into slots [target_len, target_len+S) and keeps this call's taps
        ([S, taps*hidden], on the device for GPU backends) for `draft_context`. Does not
        move target_len: the caller `commit`s how many of the S positions are real.
        Must raise DFlashError if target_len + S > max_len or S > max_chunk. Used for prefill (S up to the
        prefill chunk), verify (S <= block_size) and plain 1-token decoding.
        """
        out = self._target(ids, want_logits)
        self._pending = len(ids)  # what `commit` may keep
        return out

    @abstractmethod
    def _target(self, ids: np.ndarray, want_logits: bool) -> TargetOut:
        """The graph call behind `target` (the checks above are the implementation's)."""

    def commit(self, n: int) -> None:
        """Keep the first n (0 <= n <= S) positions of the last `target` call: target_len += n.

        The other S - n slots stay scratch (this is the whole rollback).
        """
        if not 0 <= n <= self._pending:
            raise InternalError(f"commit({n}) but the last target call wrote {self._pending} positions")
        if self.states is not None:  # a hybrid target's rollback: only n positions reach the states
            self.states.commit(n)
        self.target_len += n
        self._pending = 0

    @abstractmethod
    def draft_context(self, n: int) -> None:
        """Project the first n taps of the last `target` call into the drafter's context cache.

        Runs draft_context.onnx on taps[:n] at positions context_len .. context_len+n-1,
        writes ctx_key/ctx_value into those slots and does context_len += n. Call it after
        `commit(n)` with the same n (prefill: once per chunk; a round: anchor + accepted
        drafts), so the context cache ends up holding every position before the next anchor.
        """

    @abstractmethod
    def draft_block(self, anchor: int) -> Draft:
        """One drafter pass over [anchor, mask x (K-1)] at positions context_len .. context_len+K-1.

        K is the manifest's block_size (static). Attends to context slots [0, context_len)
        and the block (non-causal). Returns the Draft: ids [K-1] int64 (in-graph ArgMax) and,
        when the graph has them, their top-1 probabilities (adaptive verify). Caches nothing: the block's own K/V are never kept.
        """

    # -- lifecycle ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the sequence (both lengths to 0); buffers are kept for the next one."""
        self.target_len = self.context_len = self._pending = 0
        if self.states is not None:
            self.states.reset()

    def keep(self, n: int) -> None:
        """Keep only the first n positions of both caches: a new sequence that starts with
        the same n tokens as the last one (prompt reuse) prefills only what follows."""
        if not 0 <= n <= self.target_len:
            raise InternalError(f"keep({n}) but the target cache holds {self.target_len} positions")
        if self.states is not None and n != self.target_len:
            if n:
                raise InternalError(f"keep({n}) of {self.target_len} positions: a hybrid target keeps all or none")
            self.states.reset()
        self.target_len, self.context_len, self._pending = n, min(self.context_len, n), 0

    def reusable(self, n: int) -> int:
        """The longest prefix, at most n positions, of the cached sequence that `keep` can keep.
        Attention caches keep any prefix; a recurrent state (hybrid targets) all or nothing."""
        if self.states is None or n == self.target_len:
            return n
        return 0

    def close(self) -> None:
        """Release sessions/engines and device memory (optional)."""

    @property
    def provider(self) -> str:
        """What runs the graphs, for reports ("onnxruntime:CPUExecutionProvider", "tensorrt")."""
        return type(self).__name__
