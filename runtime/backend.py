"""The backend interface: what a graph runner (ONNX Runtime, TensorRT) must provide.

A backend loads one exported directory (runtime/contract.py), owns the KV buffers and
runs the three graphs. It decides nothing: the loop (runtime/loop.py) picks tokens,
accepts drafts and tells the backend how many positions to keep.

State, all in positions of the one sequence being generated (row 0; rows: see Backend):

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
from .names import Names
from .manifest import Manifest
from .errors import DFlashError, InternalError
from .hybrid import LinearStates
from .window import WindowRings


@dataclass
class TargetOut:
    next_ids: np.ndarray  # [S] int64 (batch-1 calls) or [R, N] (target_rows): the target's argmax (in-graph)
    logits: np.ndarray | None  # [S, V] / [R, N, V] float32, only when asked for (sampling needs them)


@dataclass
class Draft:
    """What one drafter pass proposes for the K-1 masked positions of the block (or the first n
    of them: a head over the drafts a verify uses, contract.DRAFT_INDEX)."""

    ids: np.ndarray  # [K-1] (or [n]) int64: the in-graph ArgMax
    conf: np.ndarray | None = None  # [K-1] (or [n]) float32 top-1 probabilities (adaptive verify); None: not exported


class Backend(ABC):
    """Runs target.onnx / draft_context.onnx / draft_block.onnx (or their engines).

    Rows (ragged batches, runtime/loop.py): `max_batch` sequences share the buffers, each
    with its own `lengths` / `ctx_lengths` / `pending`. The `*_rows` methods run one call
    over several rows; the batch-1 methods (`target`, `commit`, ...) are row 0. A backend
    that only runs batch 1 (max_batch 1) implements the batch-1 methods and inherits the
    `*_rows` ones below, which call them.
    """

    manifest: Manifest
    max_len: int
    max_chunk: int
    max_batch: int = 1
    has_drafter: bool = True
    verify_per_row: bool = False  # a verify of several rows runs one call per row (the controller's cost model)
    limit = ("exported max context", "export with a larger --max-context")  # what bounds max_len, and the fix
    names: Names  # every per-layer tensor name, built once at load (names.names_of)
    states: LinearStates | None = None  # hybrid targets: the committed DeltaNet states, host side (runtime/hybrid.py)
    rings: WindowRings | None = None  # sliding-window targets: the sliding layers' rings, host side (runtime/window.py)
    _rows: tuple | None = None  # (lengths, ctx_lengths, pending), made on first use

    # -- per-row lengths ------------------------------------------------------------------

    def _row_state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._rows is None or len(self._rows[0]) != self.max_batch:
            self._rows = tuple(np.zeros(self.max_batch, np.int64) for _ in range(3))
        return self._rows

    lengths = property(lambda self: self._row_state()[0], doc="[max_batch] valid target cache positions per row")
    ctx_lengths = property(lambda self: self._row_state()[1], doc="[max_batch] valid drafter context positions per row")
    pending = property(lambda self: self._row_state()[2], doc="[max_batch] positions the last target call wrote per row")

    def _row0(i: int):  # noqa: N805: row 0's entry of one of the arrays above, as an int attribute
        def get(self):
            return int(self._row_state()[i][0])

        def put(self, v):
            self._row_state()[i][0] = v
        return property(get, put)

    target_len, context_len, _pending = _row0(0), _row0(1), _row0(2)
    del _row0

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

    def check_room(self, rows, counts) -> None:
        """One line when a row's `counts` new positions would pass max_len; requests are refused
        before this (sampling.check_request)."""
        for b, c in zip(rows, counts):
            if self.lengths[b] + c > self.max_len:
                raise self.past_limit(f"sequence of {self.lengths[b] + c} positions exceeds")

    def past_limit(self, what: str) -> DFlashError:
        """The one-line error for `what` (e.g. "sequence of N positions exceeds") past max_len,
        naming what bounds it and the fix (`limit`)."""
        return DFlashError(f"{what} the {self.limit[0]} {self.max_len}; shorten the request or {self.limit[1]}")

    def commit(self, n: int) -> None:
        """Keep the first n (0 <= n <= S) positions of the last `target` call: target_len += n.

        The other S - n slots stay scratch (this is the whole rollback).
        """
        self.commit_rows([0], [n])

    def commit_rows(self, rows, n) -> None:
        """`commit` for each of `rows` with its own n (the rows of the last target call)."""
        lengths, _, pending = self._row_state()
        for b, k in zip(rows, n):
            if not 0 <= k <= pending[b]:
                raise InternalError(f"commit({k}) of row {b} but the last target call wrote {pending[b]} positions")
        if self.states is not None:  # a hybrid target's rollback: only n positions reach the states
            self.states.commit_rows(rows, n)
        if self.rings is not None:  # and a sliding layer's: only n positions reach its ring
            self.rings.commit_rows(rows, n, lengths)
        for b, k in zip(rows, n):
            lengths[b] += k
            pending[b] = 0

    @abstractmethod
    def draft_context(self, n: int) -> None:
        """Project the first n taps of the last `target` call into the drafter's context cache.

        Runs draft_context.onnx on taps[:n] at positions context_len .. context_len+n-1,
        writes ctx_key/ctx_value into those slots and does context_len += n. Call it after
        `commit(n)` with the same n (prefill: once per chunk; a round: anchor + accepted
        drafts), so the context cache ends up holding every position before the next anchor.
        """

    @abstractmethod
    def draft_block(self, anchor: int, scored: int | None = None) -> Draft:
        """One drafter pass over [anchor, mask x (K-1)] at positions context_len .. context_len+K-1.

        K is the manifest's block_size (static). Attends to context slots [0, context_len)
        and the block (non-causal). Returns the Draft: ids [K-1] int64 (in-graph ArgMax) and,
        when the graph has them, their top-1 probabilities (adaptive verify). Caches nothing: the block's own K/V are never kept.
        `scored` n (1..K-1): only the first n drafts are needed; where the graph takes
        draft_index (contract.DRAFT_INDEX) its head scores only those and the Draft holds n,
        else all K-1 (a caller reads the first n either way).
        """

    # -- several rows per call (batch-1 backends: row 0 through the methods above) ----------

    def target_rows(self, rows: list[int], ids: np.ndarray, counts: np.ndarray, picks: np.ndarray | None,
                    want_logits: bool = False) -> TargetOut:
        """One target call over `rows` (one row, or all max_batch rows): ids [R, S] (row r's
        first counts[r] are real, the rest padding), each row at its own length. Returns the
        argmax (and logits) at `picks` [R, N] (positions 0..S-1; None: all S)."""
        self._one_row(rows)
        res = self.target(np.asarray(ids[0, : counts[0]]), want_logits)
        at = np.arange(int(counts[0])) if picks is None else np.asarray(picks[0])
        return TargetOut(res.next_ids[at][None], None if res.logits is None else res.logits[at][None])

    def draft_context_rows(self, rows: list[int], n) -> None:
        """`draft_context` per row with its own n (the rows of the last target call; n may be 0)."""
        self._one_row(rows)
        if n[0]:
            self.draft_context(int(n[0]))

    def draft_block_rows(self, rows: list[int], anchors, scored: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """`draft_block` per row at its own context length: (draft ids [R, K-1], conf [R, K-1] or None);
        `scored`: as draft_block's, [R, n] where the graph takes draft_index."""
        self._one_row(rows)
        d = self.draft_block(int(anchors[0]), scored)
        return d.ids[None], None if d.conf is None else d.conf[None]

    def draft_logits_rows(self, n: int) -> np.ndarray:
        """The last `draft_block_rows` call's draft_logits [n, K-1 (or its scored), draft vocab] on the host
        (after the drafter's logit transforms): rejection sampling's q. Read only when
        `samples_drafts`."""
        raise InternalError(f"{type(self).__name__} does not return draft logits")

    def draft_walk_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """DFlash 2 (a manifest with a selector): the last `draft_block_rows` call's candidates
        [n, K-1, k] and walk scores [n, K-1, k, k] on the host (runtime/walk.py)."""
        raise InternalError(f"{type(self).__name__} does not return draft candidates")

    @property
    def samples_drafts(self) -> bool:
        """Whether rejection sampling can run: draft logits on the host and, for a reduced draft
        vocabulary, its ids in the manifest (else sampled rows compare argmax drafts)."""
        return (type(self).draft_logits_rows is not Backend.draft_logits_rows and self.has_drafter
                and (not getattr(self.manifest, "draft_vocab", None) or self.draft_vocab_ids is not None))

    @property
    def draft_vocab_ids(self) -> np.ndarray | None:
        """Target ids of the draft logits' columns (a reduced draft vocabulary), None: all."""
        return draft_vocab_ids(self.manifest)

    width: int = 1  # rows a call over all rows carries (runtime/loop.py keeps its rows in 0..width-1)
    _wanted: int | None = None  # a width set but not laid out yet (set_width)

    def set_width(self, w: int) -> None:
        """Calls over all rows carry rows 0..w-1 from now on. Several rows: the caches are laid
        out again for w columns at the next call (`_layout`: a join or a leave, not a call; a
        leave and a join at one round boundary copy nothing). One row: nothing to lay out."""
        if not 0 <= w <= self.max_batch:
            raise InternalError(f"width {w} of a {self.max_batch}-row backend")
        if self.max_batch == 1:
            self.width = w
        else:
            self._wanted = w

    def _layout(self) -> None:
        """Apply the last set_width (before a call over rows): the kept rows' valid prefixes copied once."""
        w, self._wanted = self._wanted, None
        if w is not None and w != self.width:
            old, self.width = self.width, w
            self._relayout(min(old, w), old)

    def _relayout(self, keep: int, old: int) -> None:
        """Rows 0..keep-1's valid cache prefixes, laid out for `old` columns, into the layout for `width`."""
        raise InternalError(f"{type(self).__name__} holds one row")

    def move_row(self, src: int, dst: int) -> None:
        """Row src's sequence moves to slot dst (the loop keeps its rows in 0..width-1); src is freed."""
        if self.max_batch == 1:
            raise InternalError(f"{type(self).__name__} holds one row")
        self._move_caches(src, dst)
        if self.states is not None:
            self.states.move(src, dst)
        if self.rings is not None:
            self.rings.move(src, dst)
        for a in self._row_state():
            a[dst] = a[src]
        self.reset_row(src)

    def _move_caches(self, src: int, dst: int) -> None:
        """Copy row src's valid cache prefixes into slot dst (backends of several rows)."""
        raise InternalError(f"{type(self).__name__} holds one row")

    def _one_row(self, rows) -> None:
        if list(rows) != [0]:
            raise InternalError(f"{type(self).__name__} runs one row (row 0), not rows {list(rows)}")

    # -- lifecycle ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the sequences (all lengths to 0); buffers are kept for the next ones."""
        for a in self._row_state():
            a[:] = 0
        if self.states is not None:
            self.states.reset()

    def reset_row(self, b: int) -> None:
        """Forget row b's sequence (a batch row that finished: its slot is free)."""
        for a in self._row_state():
            a[b] = 0
        if self.states is not None:
            self.states.reset(b)

    def keep(self, n: int) -> None:
        """Keep only the first n positions of both caches: a new sequence that starts with
        the same n tokens as the last one (prompt reuse) prefills only what follows."""
        if not 0 <= n <= self.target_len:
            raise InternalError(f"keep({n}) but the target cache holds {self.target_len} positions")
        if self.states is not None and n != self.target_len:
            if n:
                raise InternalError(f"keep({n}) of {self.target_len} positions: a hybrid target keeps all or none")
            self.states.reset()
        if self.rings is not None and n not in (self.target_len, 0) and self.target_len > self.rings.ring:
            raise InternalError(f"keep({n}) of {self.target_len} positions: the sliding layers' rings were overwritten")
        self.target_len, self.context_len, self._pending = n, min(self.context_len, n), 0

    def reusable(self, n: int) -> int:
        """The longest prefix, at most n positions, of the cached sequence that `keep` can keep.
        Attention caches keep any prefix; a recurrent state (hybrid targets) all or nothing; a
        sliding layer's ring any prefix until it has wrapped, then all or nothing."""
        if self.rings is not None and n != self.target_len and self.target_len > self.rings.ring:
            return 0
        if self.states is None or n == self.target_len:
            # a drafter context ring (runtime/ort/row_cache.py) keeps only its latest positions: no shorter context
            return n if n >= self.context_len or not C.ring(self.manifest) else 0
        return 0

    # -- what only some backends do: each declared here, refused by the others ------------

    forks: bool = False  # whether `fork` gives another sequence over the same weights

    def fork(self) -> "Backend":
        """Another sequence over the same weights (its own caches, lengths at 0): a server slot each."""
        raise InternalError(f"{type(self).__name__} does not share its weights between sequences")

    def last_taps(self, rows: int) -> np.ndarray | None:
        """A host copy of the last one-position call's taps [rows, T*H], for `context_from_taps`
        later (runtime/controller.py's plain steps). None: no host taps, so each plain step's
        position is projected at once (`draft_context_rows`)."""
        return None

    def context_from_taps(self, b: int, taps: np.ndarray) -> None:
        """Row b's drafter context gains the positions of `taps` [n, T*H] (kept from `last_taps`)."""
        raise InternalError(f"{type(self).__name__} keeps no host taps")

    parks_rows: bool = False  # whether `save_row` / `load_row` copy a row's caches out and back (runtime/prefix.py)

    def save_row(self, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of row b's valid caches: (target K/V of its `lengths[b]` positions, drafter
        context of its `ctx_lengths[b]` positions or None), in the backend's own layout."""
        raise InternalError(f"{type(self).__name__} cannot park a row's caches")

    def load_row(self, b: int, kv: np.ndarray, ctx: np.ndarray | None, n: int, ctx_n: int) -> None:
        """Slot b holds the first n target and ctx_n drafter positions of `save_row`'s copies, nothing else."""
        raise InternalError(f"{type(self).__name__} cannot park a row's caches")

    def close(self) -> None:
        """Release sessions/engines and device memory (optional)."""

    @property
    def provider(self) -> str:
        """What runs the graphs, for reports ("onnxruntime:CPUExecutionProvider", "tensorrt")."""
        return type(self).__name__


def draft_vocab_ids(m: Manifest) -> np.ndarray | None:
    """The manifest's draft vocabulary ids (exports since rejection sampling record them)."""
    dv = getattr(m, "draft_vocab", None)
    if not dv:
        return None
    ids = dv.get("ids")
    return None if ids is None else np.asarray(ids, np.int64)

def span(rows):
    """`rows` as numpy indexes them fastest: consecutive rows (the loop's 0..n-1) as a slice. A list
    index costs numpy several microseconds an operation where a slice costs a fraction of one,
    and a round of a small model makes several such operations a call."""
    b0 = rows[0]
    return slice(b0, b0 + len(rows)) if list(rows) == list(range(b0, b0 + len(rows))) else rows


def scored_drafts(m: Manifest, scored: int | None) -> int:
    """The drafts a draft_block call scores: `scored` within 1..K-1 (None: all K-1) where the graph
    takes draft_index (contract.DRAFT_INDEX), else all K-1."""
    k = m.block_size - 1
    return min(max(1, scored or k), k) if C.draft_index(m) else k


def check_context_counts(rows, n, last: int, lengths: np.ndarray, max_len: int) -> None:
    """Each row's new context positions: within the last target call's and the cache's room."""
    for b, k in zip(rows, n):
        if not 0 <= k <= last or lengths[b] + k > max_len:
            raise InternalError(f"draft_context({k}) of row {b} at {lengths[b]} (max {max_len})")
