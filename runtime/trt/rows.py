"""TensorRT backend, part 2: several rows per engine call (ragged exports, `max_batch` > 1).

NOT YET EXECUTED ON TENSORRT HARDWARE (no NVIDIA GPU in development). The suite runs it against
the double of the real TensorRT 10.12 / 11.4 bindings and the hand-written cuda-python stand-in
(tests/trt_fake.py, whose strided copy refuses overlapping areas as CUDA does), every row's tokens
compared with ONNX Runtime's; what TensorRT computes on a GPU is tests/test_trt_gpu.py's to show.

The layout is ONNX Runtime's (runtime/ort/backend.py, docs/batching.md): device caches are
position-major, `[max_len, W, Hkv, D]` per layer for the W rows a call carries, so the valid
prefix of every row, `[P, W, Hkv, D]`, is one region bound in place (set_tensor_address) and a
row's slots past its own length are masked (`past_lengths`, `ctx_lengths`). The new K/V of a
call land in a scratch `[R, S, Hkv, D]` and each row's kept positions are written at its own
length by one strided copy per layer (cudaMemcpy2DAsync, destination pitch W positions): a
call's new positions only, never the cache. A joining row's prefill runs alone; past its first
chunk its prefix is gathered by one strided copy per layer. A join or a leave lays the kept
rows out again for the new width (through a scratch: CUDA's 2D copies may not overlap).
A backend of several rows is run through these `*_rows` calls (runtime/loop.py does); the
batch-1 methods (`target`, `draft_block`, ...) bind one-row caches and are for max_batch 1.
"""

from __future__ import annotations

import numpy as np

from .. import contract as C
from ..backend import Backend, TargetOut, check_context_counts
from ...errors import DFlashError, InternalError
from .walk import TrtSelector


def check_engine_rows(record: dict | None, max_batch: int) -> None:
    """One line when the engines (`build --max-batch`) cannot take `max_batch` rows, or are missing."""
    if max_batch < 1:
        raise DFlashError(f"--batch must be at least 1 (got {max_batch})")
    build = f"`dflash-export build OUT --max-batch {max_batch}`"
    if not record:
        raise DFlashError("this directory has no TensorRT engines; build them first with "
                          + (build if max_batch > 1 else "`dflash-export build OUT`"))
    built = int(record.get("max_batch", 1))
    if max_batch > built:
        rows = "batch 1 only" if built == 1 else f"batch 1..{built}"
        raise DFlashError(f"--batch {max_batch}: the engines were built for {rows}; rebuild them with {build}"
                          + (f", or use --batch {built}" if built > 1 else ""))


class TrtRows(TrtSelector):
    """The `*_rows` calls of TensorRTBackend for max_batch > 1 (one row: Backend's, over the
    batch-1 methods). Uses the backend's buffers, sized for max_batch rows at load."""

    def _alloc_rows(self, ms: int) -> None:
        """The ragged graphs' per-row inputs (past and context lengths, logits picks) and, for
        several rows, a gathered row's prefix per cache and a relayout scratch. `ms`: the most
        positions of one call (max(max_prompt, max_batch * K))."""
        B, L = self.max_batch, len(self.kv)
        self.d_plen, self.d_clen, self.d_picks = self._malloc(B * 8), self._malloc(B * 8), self._malloc(ms * 8)
        self.h_plen, self.h_clen = np.zeros(B, np.int64), np.zeros(B, np.int64)
        self.h_picks = np.arange(ms, dtype=np.int64)
        self._h2d(self.d_picks, self.h_picks)  # one row: logits_index = 0..S-1, a prefix of this, never changes
        if B > 1:
            biggest = max(self.row, self.drow)
            self.d_gather = [self._malloc(self.max_len * biggest) for _ in range(2 * max(L, len(self.ckv)))]
            self.d_relayout = self._malloc(self.max_len * B * biggest)

    # -- strided device copies ----------------------------------------------------------------

    def _copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """`height` rows of `width` bytes, each `spitch` apart at src and `dpitch` apart at dst."""
        if height > 0:
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
            self.cuda_check(self.cudart.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, self.stream))

    def _caches(self):
        """(buffer, bytes per position of one row, valid length of each row) of every cache."""
        for kv in self.kv:
            if kv is not None:
                yield kv[0], self.row, self.lengths
                yield kv[1], self.row, self.lengths
        for kv in self.ckv:
            yield kv[0], self.drow, self.ctx_lengths
            yield kv[1], self.drow, self.ctx_lengths

    def _scatter(self, pairs: list, row: int, rows, lengths, s: int, counts) -> None:
        """For each (cache, scratch) pair: row r's first counts[r] new positions ([R, s] in the
        scratch, `row` bytes each) into the cache at that row's length."""
        W = self.width
        for base, scr in pairs:
            for r, b in enumerate(rows):
                at = int(lengths[b])
                n = min(int(counts[r]), self.max_len - at)
                self._copy2d(base + (at * W + b) * row, W * row, scr + r * s * row, row, row, n)

    def _gather(self, base: int, row: int, b: int, p: int, into: int) -> int:
        """Row b's first p positions, contiguous in `into`."""
        self._copy2d(into, row, base + b * row, self.width * row, row, p)
        return into

    def _relayout(self, keep: int, old: int) -> None:
        """The kept rows' valid prefixes, `old` positions a pitch, rewritten `width` a pitch
        (through a scratch: CUDA's 2D copies may not overlap)."""
        w = self.width
        if keep:
            for base, row, lens in self._caches():
                p = int(lens[:keep].max())
                if p:
                    self._copy2d(self.d_relayout, w * row, base, old * row, keep * row, p)
                    self._d2d(base, self.d_relayout, p * w * row)

    def _move_caches(self, src: int, dst: int) -> None:
        for base, row, lens in self._caches():
            p = int(lens[src])
            self._gather(base, row, src, p, self.d_relayout)
            self._copy2d(base + dst * row, self.width * row, self.d_relayout, row, row, p)

    # -- the calls ----------------------------------------------------------------------------

    def _one_call(self, rows) -> None:
        if len(rows) not in (1, self.width):
            raise InternalError(f"a call over {len(rows)} rows at width {self.width}")

    def target_rows(self, rows, ids, counts, picks=None, want_logits=False) -> TargetOut:
        if self.max_batch == 1:
            return Backend.target_rows(self, rows, ids, counts, picks, want_logits)
        self._layout()
        self._one_call(rows)
        N_, m, k = self.names, self.manifest, self.k
        ids = np.asarray(ids, np.int64)
        R, S = ids.shape
        lengths = self.lengths
        self.check_room(rows, counts)
        prof = 0 if S <= k else 1
        if (prof and S > self.max_prompt) or (R > 1 and S > k):
            raise DFlashError(f"a {S}-token call over {R} rows exceeds the engines' profiles (--max-prompt "
                              f"{self.max_prompt} for one row, the block {k} for several)")
        N = S if picks is None else np.asarray(picks).shape[1]
        P = int(lengths[rows].max())
        self.h_ids[: R * S] = ids.ravel()
        self.h_pos[: R * S] = (lengths[rows, None] + np.arange(S)).ravel()
        self.h_plen[:R] = lengths[rows]
        self.h_picks[: R * N] = (np.broadcast_to(np.arange(S), (R, S)) if picks is None else np.asarray(picks)).ravel()
        for d, h in ((self.d_ids, self.h_ids[: R * S]), (self.d_pos, self.h_pos[: R * S]),
                     (self.d_plen, self.h_plen[:R]), (self.d_picks, self.h_picks[: R * N])):
            self._h2d(d, h)
        addrs = {C.INPUT_IDS: self.d_ids, C.POSITION_IDS: self.d_pos, C.PAST_LENGTHS: self.d_plen,
                 C.LOGITS_INDEX: self.d_picks, C.LOGITS: self.d_logits, C.NEXT_IDS: self.d_next, C.TAPS: self.d_taps}
        if self.states is not None:
            self.states.layout(R, S)
            self._states_to_device(addrs, rows[0] if R == 1 else 0, R)
        one = R == 1 and self.width > 1 and P > 0  # a joining row among others: its prefix gathered
        pairs = []
        for i, kv in enumerate(self.kv):
            if kv is None:
                continue
            for e, (past, new) in enumerate(((N_.past_key[i], N_.new_key[i]), (N_.past_value[i], N_.new_value[i]))):
                addrs[past] = self._gather(kv[e], self.row, rows[0], P, self.d_gather[2 * i + e]) if one else kv[e]
                addrs[new] = self.d_scratch[2 * i + e]
                pairs.append((kv[e], self.d_scratch[2 * i + e]))
        self._run(C.TARGET, prof, addrs, batch=R, seq=S, past=P, picks=N)
        self._scatter(pairs, self.row, rows, lengths, S, counts)
        self._d2h(self.h_next[: R * N], self.d_next)
        if self.states is not None:  # the increments to commit, [R, S, ...] on the host
            for i in self.states.layers:
                for name in (N_.new_conv[i], *N_.delta[i]):
                    self._d2h(self.states.view(name).reshape(-1), self.d_linear[name])
        if want_logits:
            self._d2h(self.h_logits[: R * N], self.d_logits)
        self._sync()
        self.pending[rows] = counts
        self._taps_n = S
        logits = self.h_logits[: R * N].reshape(R, N, -1) if want_logits else None
        return TargetOut(self.h_next[: R * N].reshape(R, N), logits)

    def draft_context_rows(self, rows, n) -> None:
        if self.max_batch == 1:
            return Backend.draft_context_rows(self, rows, n)
        self._layout()
        self._one_call(rows)
        N_, R, lengths = self.names, len(rows), self.ctx_lengths
        c = int(n[0]) if R == 1 else self._taps_n  # several rows: each projects the whole last call
        if c == 0:
            return
        check_context_counts(rows, n, self._taps_n, lengths, self.max_len)
        self.h_cpos[: R * c] = (lengths[rows, None] + np.arange(c)).ravel()
        self._h2d(self.d_cpos, self.h_cpos[: R * c])
        addrs = {C.TAPS: self.d_taps, C.CTX_POSITION_IDS: self.d_cpos}
        pairs = []
        for j, (kb, vb) in enumerate(self.ckv):
            for name, base, scr in ((N_.ctx_key[j], kb, self.d_scratch[2 * j]), (N_.ctx_value[j], vb, self.d_scratch[2 * j + 1])):
                addrs[name] = scr
                pairs.append((base, scr))
        self._run(C.DRAFT_CONTEXT, 0, addrs, batch=R, ctx=c)
        self._scatter(pairs, self.drow, rows, lengths, c, n)
        self._sync()
        lengths[rows] += n

    def draft_block_rows(self, rows, anchors):
        if self.max_batch == 1:
            return Backend.draft_block_rows(self, rows, anchors)
        self._layout()
        self._one_call(rows)
        N_, m, k, R = self.names, self.manifest, self.k, len(rows)
        lengths = self.ctx_lengths
        if lengths[rows].min() < 1:
            raise InternalError("draft_block_rows() before any context (prefill first)")
        P = int(lengths[rows].max())
        bids = self.h_bids[: R * k].reshape(R, k)
        bids[:] = m.mask_token_id
        bids[:, 0] = anchors
        self.h_bpos[: R * k] = (lengths[rows, None] + np.arange(k)).ravel()
        self.h_clen[:R] = lengths[rows]
        for d, h in ((self.d_bids, self.h_bids[: R * k]), (self.d_bpos, self.h_bpos[: R * k]), (self.d_clen, self.h_clen[:R])):
            self._h2d(d, h)
        addrs = {C.BLOCK_IDS: self.d_bids, C.BLOCK_POSITION_IDS: self.d_bpos, C.CTX_LENGTHS: self.d_clen} | self.draft_outputs
        one = R == 1 and self.width > 1
        for j, (kb, vb) in enumerate(self.ckv):
            for e, (name, base) in enumerate(((N_.past_ctx_key[j], kb), (N_.past_ctx_value[j], vb))):
                addrs[name] = self._gather(base, self.drow, rows[0], P, self.d_gather[2 * j + e]) if one else base
        self._run(C.DRAFT_BLOCK, 0, addrs, batch=R, past_ctx=P)
        n = R * (k - 1)
        self._d2h(self.h_draft[:n], self.d_draft)
        if self.d_conf is not None:
            self._d2h(self.h_conf[:n], self.d_conf)
        self._sync()
        conf = self.h_conf[:n].reshape(R, k - 1) if self.d_conf is not None else None
        return self.h_draft[:n].reshape(R, k - 1), conf

    def draft_logits_rows(self, n: int) -> np.ndarray:
        """The last draft_block call's draft_logits [n, K-1, V_draft], copied to the host."""
        k = self.k
        out = self.h_dlogits[: n * (k - 1)]
        self._d2h(out, self.d_dlogits)
        self._sync()
        return out.reshape(n, k - 1, -1)
