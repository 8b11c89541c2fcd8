"""The TensorRT backend: three engines (runtime/trt/engines.py) on one CUDA stream over device
buffers it owns, one row or several per call.

`TensorRTBackend` implements the Backend interface (runtime/backend.py) with the name-based
execution API that TensorRT 10 introduced and 11 keeps (set_input_shape, set_tensor_address,
execute_async_v3) and cuda-python's runtime bindings for memory and the stream. Shapes and
limits come from runtime/profiles.py; this file only moves bytes and runs engines.

NOT YET EXECUTED ON TENSORRT HARDWARE: it needs `tensorrt`, `cuda-python` and an NVIDIA GPU.
The test suite runs it against a double of the real TensorRT 10.12 and 11.4 Python bindings
(tests/trt_double.py: every attribute, call, argument and return value checked against
NVIDIA's own signatures; what an engine computes is simulated with ONNX Runtime) and a
hand-written cuda-python stand-in (tests/trt_fake.py, whose strided copy refuses overlapping
areas as CUDA does); on a GPU machine tests/test_trt_gpu.py runs it for real.

Rows (ragged exports, `max_batch` > 1). The layout is ONNX Runtime's (runtime/ort/backend.py, docs/batching.md): device caches are
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

The draft head (exports with `draft_index`, contract.DRAFT_INDEX): draft_block's profile takes
1..K-1 drafts; a call binds a prefix of one device copy of 0..K-2 and its outputs are
[R, n], the first R * n elements of each output buffer.

DFlash 2. A DFlash 2 `draft_block` also writes `draft_candidates` [B, K-1, k] and `draft_scores`
[B, K-1, k, k] (runtime/walk.py): every engine output needs an address, so they get device
buffers sized for max_batch rows; greedy rounds read only `draft_ids` (the graph's own walk),
sampled rows copy the two to the host for the walk (`draft_walk_rows`).
"""

from __future__ import annotations

import contextlib
from functools import cached_property
from pathlib import Path

import numpy as np

from ..backend import Backend, Draft, TargetOut, check_context_counts, scored_drafts
from .. import contract as C
from ..names import names_of
from ..contract import DRAFT_BLOCK, DRAFT_CONTEXT, TARGET, draft_vocab_size
from ..manifest import Manifest, load_manifest
from ..errors import DFlashError, InternalError
from ..hybrid import LinearStates
from .engines import ITEMSIZE, Engines, check_engine_record, check_engine_rows, cuda_check, gpu_info, import_tensorrt

ALIGN = 256  # bytes: device addresses handed to TensorRT are kept 256-byte aligned


class TensorRTBackend(Backend):
    """Runs the three engines on one CUDA stream over device KV buffers it owns.

    KV buffers are sequence-major [1, max_len, Hkv, D] (as on ONNX Runtime): a call binds
    the valid prefix in place with set_tensor_address (no copy) and the graph's new K/V
    outputs are bound straight into the slots after it when that address is 256-byte
    aligned; otherwise they land in a scratch buffer and only those S rows are copied.
    `max_batch` > 1 (engines built with `--max-batch`): position-major caches (the module docstring).

    Hybrid targets (docs/hybrid.md): a linear-attention layer's committed states and a call's
    per-position increments are runtime/hybrid.py's host buffers, the same code and commit as
    on ONNX Runtime; this backend only copies the increments (S rows) to the host after each
    call and the committed states back to the device before the next call that follows a commit.

    No CUDA graphs: a graph bakes in shapes and addresses, and the past length changes on
    every call, so within one generation no captured graph would ever be replayed.
    """

    def __init__(self, out_dir: str | Path, manifest: Manifest | None = None, *, drafter: bool = True,
                 device: int = 0, max_batch: int = 1):
        self.stream, self._allocs, self.engines = None, [], None  # what close() frees, so far nothing
        with contextlib.ExitStack() as undo:  # raising partway frees what was allocated until then
            undo.callback(self.close)
            self._open(out_dir, manifest, drafter, device, max_batch)
            undo.pop_all()  # opened: close() frees it all from now on

    def _open(self, out_dir, manifest: Manifest | None, drafter: bool, device: int, max_batch: int) -> None:
        trt, cudart = import_tensorrt()
        self.trt, self.cudart = trt, cudart
        self.out = Path(out_dir)
        self.manifest = m = manifest or load_manifest(self.out)
        self.names = names_of(m)
        cc, gpu = gpu_info(cudart, device)
        rec = m.engines
        check_engine_rows(rec, max_batch)
        check_engine_record(rec, trt.__version__, cc)
        self.record = rec
        self.max_batch = B = max_batch
        self.k = m.block_size
        self.max_len = int(rec["max_context"])  # the engines', which `build --max-context` may set below the export's
        self.limit = ("TensorRT engines' max context", "rebuild them with a larger dflash-export build --max-context")
        self.max_prompt = int(rec["max_prompt"])
        self.max_chunk = self.max_prompt  # longest `target` call other than verify; the loop chunks prefill by it
        self.dtype = C.NUMPY_DTYPE[m.dtype]
        self.esize = ITEMSIZE[self.dtype]
        cuda_check(cudart.cudaSetDevice(device))
        self.stream = cuda_check(cudart.cudaStreamCreate())
        self.handle = int(self.stream)  # TensorRT takes the raw cudaStream_t as an int

        self.has_drafter = drafter
        graphs = (TARGET, DRAFT_CONTEXT, DRAFT_BLOCK) if drafter else (TARGET,)
        self.engines = Engines(trt, self.out, m, rec, graphs, self.handle, self._sync)

        L, H, D = m.target_layers, m.target_kv_heads, m.target_head_dim
        dl, dh, dd = m.draft_layers, m.draft_kv_heads, m.draft_head_dim
        self.row = H * D * self.esize  # bytes per position of one target K or V buffer
        self.drow = dh * dd * self.esize
        ms = max(self.max_prompt, self.k, B * self.k)  # most positions of one call (one row, or all)
        self.kv = [None if m.is_linear(i) else (self._malloc(self.max_len * B * self.row), self._malloc(self.max_len * B * self.row))
                   for i in range(L)]
        # hybrid target: the committed DeltaNet states and a call's per-position outputs live on the
        # host (runtime/hybrid.py, shared with ONNX Runtime); these are their device copies
        self.states = LinearStates(m, ms, B) if m.linear_layers else None
        self.d_linear = {n: self._malloc(a.nbytes) for n, a in (self.states.buf.items() if self.states else ())}
        self.ckv = [(self._malloc(self.max_len * B * self.drow), self._malloc(self.max_len * B * self.drow))
                    for _ in range(dl if drafter else 0)]
        self.taps_row = C.sizes(m)[C.TAPS_WIDTH] * self.esize
        self.d_ids, self.d_pos = self._malloc(ms * 8), self._malloc(ms * 8)
        self.d_next, self.d_logits = self._malloc(ms * 8), self._malloc(ms * m.vocab_size * 4)
        self.d_taps = self._malloc(ms * self.taps_row)
        self.d_cpos = self._malloc(ms * 8)
        bk = B * self.k  # block positions of all rows
        self.d_bids, self.d_bpos = self._malloc(bk * 8), self._malloc(bk * 8)
        self.d_draft, self.d_dlogits = self._malloc(bk * 8), self._malloc(bk * draft_vocab_size(m) * 4)
        self.d_scratch = [self._malloc(ms * max(self.row, self.drow)) for _ in range(2 * max(L, dl))]
        self.h_ids, self.h_pos = np.zeros(ms, np.int64), np.zeros(ms, np.int64)
        self.h_next, self.h_logits = np.zeros(ms, np.int64), np.zeros((ms, m.vocab_size), np.float32)
        self.h_cpos = np.zeros(ms, np.int64)
        self.h_bids, self.h_bpos = np.zeros(bk, np.int64), np.zeros(bk, np.int64)
        self.h_draft, self.h_dlogits = np.zeros(bk, np.int64), np.zeros((bk, draft_vocab_size(m)), np.float32)
        has_conf = "draft_conf" in {t.name for t in m.graphs[DRAFT_BLOCK].outputs} if drafter else False
        self.d_conf = self._malloc(bk * 4) if has_conf else None  # older exports lack it
        self.h_conf = np.zeros(bk, np.float32)
        self.h_dindex = np.arange(max(1, self.k - 1), dtype=np.int64)  # draft_index (contract.DRAFT_INDEX): a prefix
        self.d_dindex = self._malloc(self.h_dindex.nbytes)
        self._h2d(self.d_dindex, self.h_dindex)
        self._scored = self.k - 1  # drafts the last draft_block call scored (its outputs are [R, scored])
        self.ragged = C.ragged(m)  # contract.RAGGED: per-row lengths and logits picks
        self._alloc_rows(ms)
        self._taps_n = 0
        self.gpu = gpu

    # -- device memory and copies ----------------------------------------------------------

    def _malloc(self, nbytes: int) -> int:
        ptr = int(cuda_check(self.cudart.cudaMalloc(max(int(nbytes), ALIGN))))
        self._allocs.append(ptr)
        return ptr

    def _h2d(self, dst: int, arr: np.ndarray) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_check(self.cudart.cudaMemcpyAsync(dst, arr.ctypes.data, arr.nbytes, kind, self.stream))

    def _d2h(self, arr: np.ndarray, src: int) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        cuda_check(self.cudart.cudaMemcpyAsync(arr.ctypes.data, src, arr.nbytes, kind, self.stream))

    def _d2d(self, dst: int, src: int, nbytes: int) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        cuda_check(self.cudart.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream))

    def _sync(self) -> None:
        cuda_check(self.cudart.cudaStreamSynchronize(self.stream))

    def _out_addr(self, base: int, pos: int, row: int, scratch: int) -> tuple[int, bool]:
        """Address for new rows at `pos` of a cache buffer: in place if aligned, else scratch."""
        addr = base + pos * row
        return (addr, True) if addr % ALIGN == 0 else (scratch, False)

    # -- the Backend interface ------------------------------------------------------------

    def _target(self, ids: np.ndarray, want_logits: bool) -> TargetOut:
        N = self.names
        k = self.k
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        s, p = int(ids.size), self.target_len
        if s < 1:
            raise InternalError("target() needs at least one token")
        self.check_room([0], [s])
        prof = 0 if s <= k else 1
        if prof == 1 and s > self.max_prompt:
            raise DFlashError(f"a {s}-token chunk exceeds the engines' --max-prompt {self.max_prompt}; "
                              "prefill in chunks of at most that many tokens or rebuild with a larger --max-prompt")
        self.h_ids[:s] = ids
        self.h_pos[:s] = np.arange(p, p + s)
        self._h2d(self.d_ids, self.h_ids[:s])
        self._h2d(self.d_pos, self.h_pos[:s])
        addrs = {C.INPUT_IDS: self.d_ids, C.POSITION_IDS: self.d_pos, C.LOGITS: self.d_logits,
                 C.NEXT_IDS: self.d_next, C.TAPS: self.d_taps}
        if self.ragged:
            self.h_plen[0] = p
            self._h2d(self.d_plen, self.h_plen)
            addrs[C.PAST_LENGTHS], addrs[C.LOGITS_INDEX] = self.d_plen, self.d_picks
        copies = []
        if self.states is not None:
            self._states_to_device(addrs)
        for i, kv in enumerate(self.kv):
            if kv is None:  # a linear-attention layer: bound by _states_to_device
                continue
            kb, vb = kv
            for past, new, base, scr in ((N.past_key[i], N.new_key[i], kb, self.d_scratch[2 * i]),
                                         (N.past_value[i], N.new_value[i], vb, self.d_scratch[2 * i + 1])):
                addrs[past] = base
                addrs[new], inplace = self._out_addr(base, p, self.row, scr)
                if not inplace:
                    copies.append((base + p * self.row, scr, s * self.row))
        self.engines.run(TARGET, prof, addrs, seq=s, past=p, picks=s)
        for dst, src, n in copies:
            self._d2d(dst, src, n)
        self._d2h(self.h_next[:s], self.d_next)
        if self.states is not None:  # the increments to commit, on the host (rows 0..s-1 of batch 0)
            for i in self.states.layers:
                for name in (N.new_conv[i], *N.delta[i]):
                    self._d2h(self.states.buf[name][0, :s], self.d_linear[name])
        if want_logits:
            self._d2h(self.h_logits[:s], self.d_logits)
        self._sync()
        self._taps_n = s
        return TargetOut(next_ids=self.h_next[:s], logits=self.h_logits[:s] if want_logits else None)

    def _states_to_device(self, addrs: dict, at: int = 0, rows: int = 1) -> None:
        """Bind every DeltaNet tensor to its device buffer; copy the committed states there first
        if a commit or reset moved them on the host since the last call. A call over `rows` rows
        from row `at` > 0 (a joining row's prefill) gets theirs copied to the buffers' start."""
        N = self.names
        buf = self.states.buf
        for name, ptr in self.d_linear.items():
            addrs[name] = ptr
        if self.states.changed or at:
            for i in self.states.layers:
                for name in (N.conv_state[i], N.rec_state[i]):
                    self._h2d(self.d_linear[name], buf[name][at : at + rows] if at else buf[name])
            self.states.changed = bool(at)

    def draft_context(self, n: int) -> None:
        N = self.names
        c, p = int(n), self.context_len
        if not 0 < c <= self._taps_n:
            raise InternalError(f"draft_context({c}) but the last target call kept {self._taps_n} taps")
        if p + c > self.max_len:
            raise self.past_limit(f"drafter context of {p + c} positions exceeds")
        self.h_cpos[:c] = np.arange(p, p + c)
        self._h2d(self.d_cpos, self.h_cpos[:c])
        addrs = {C.TAPS: self.d_taps, C.CTX_POSITION_IDS: self.d_cpos}
        copies = []
        for j, (kb, vb) in enumerate(self.ckv):
            for name, base, scr in ((N.ctx_key[j], kb, self.d_scratch[2 * j]), (N.ctx_value[j], vb, self.d_scratch[2 * j + 1])):
                addrs[name], inplace = self._out_addr(base, p, self.drow, scr)
                if not inplace:
                    copies.append((base + p * self.drow, scr, c * self.drow))
        self.engines.run(DRAFT_CONTEXT, 0, addrs, ctx=c)
        for dst, src, nb in copies:
            self._d2d(dst, src, nb)
        self._sync()
        self.context_len += c

    def _scoring(self, scored: int | None, addrs: dict) -> int:
        """The drafts this draft_block call scores (all K-1 where the graph has no draft_index);
        binds draft_index."""
        if C.draft_index(self.manifest):
            addrs[C.DRAFT_INDEX] = self.d_dindex
        return scored_drafts(self.manifest, scored)

    def draft_block(self, anchor: int, scored: int | None = None) -> Draft:
        N = self.names
        m, k = self.manifest, self.k
        p = self.context_len
        if p < 1:
            raise InternalError("draft_block() before any context (prefill first)")
        if p >= self.max_len:
            raise self.past_limit(f"a block at position {p} is past")
        self.h_bids[0] = int(anchor)
        self.h_bids[1:] = m.mask_token_id
        self.h_bpos[:] = np.arange(p, p + k)
        self._h2d(self.d_bids, self.h_bids)
        self._h2d(self.d_bpos, self.h_bpos)
        addrs = {C.BLOCK_IDS: self.d_bids, C.BLOCK_POSITION_IDS: self.d_bpos} | self.draft_outputs
        if self.ragged:
            self.h_clen[0] = p
            self._h2d(self.d_clen, self.h_clen)
            addrs[C.CTX_LENGTHS] = self.d_clen
        for j, (kb, vb) in enumerate(self.ckv):
            addrs[N.past_ctx_key[j]], addrs[N.past_ctx_value[j]] = kb, vb
        n = self._scored = self._scoring(scored, addrs)
        self.engines.run(DRAFT_BLOCK, 0, addrs, past_ctx=p, scored=n)
        self._d2h(self.h_draft[:n], self.d_draft)
        if self.d_conf is not None:
            self._d2h(self.h_conf[:n], self.d_conf)
        self._sync()
        return Draft(self.h_draft[:n], self.h_conf[:n] if self.d_conf is not None else None)

    # -- several rows per call (max_batch > 1) ---------------------------------------------

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
            cuda_check(self.cudart.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, self.stream))

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
        N_, k = self.names, self.k
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
        self.engines.run(C.TARGET, prof, addrs, batch=R, seq=S, past=P, picks=N)
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
        self.engines.run(C.DRAFT_CONTEXT, 0, addrs, batch=R, ctx=c)
        self._scatter(pairs, self.drow, rows, lengths, c, n)
        self._sync()
        lengths[rows] += n

    def draft_block_rows(self, rows, anchors, scored=None):
        if self.max_batch == 1:
            return Backend.draft_block_rows(self, rows, anchors, scored)
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
        s = self._scored = self._scoring(scored, addrs)
        self.engines.run(C.DRAFT_BLOCK, 0, addrs, batch=R, past_ctx=P, scored=s)
        n = R * s
        self._d2h(self.h_draft[:n], self.d_draft)
        if self.d_conf is not None:
            self._d2h(self.h_conf[:n], self.d_conf)
        self._sync()
        conf = self.h_conf[:n].reshape(R, s) if self.d_conf is not None else None
        return self.h_draft[:n].reshape(R, s), conf

    def draft_logits_rows(self, n: int) -> np.ndarray:
        """The last draft_block call's draft_logits [n, its scored drafts (K-1 without draft_index), V_draft],
        copied to the host."""
        s = self._scored
        out = self.h_dlogits[: n * s]
        self._d2h(out, self.d_dlogits)
        self._sync()
        return out.reshape(n, s, -1)

    # -- DFlash 2: the selector's outputs --------------------------------------------------

    @cached_property
    def draft_outputs(self) -> dict[str, int]:
        """Addresses of draft_block's outputs (ids, logits, conf, and DFlash 2's candidates and
        scores, whose buffers are made here), built once, on the first draft."""
        out = {C.DRAFT_IDS: self.d_draft, C.DRAFT_LOGITS: self.d_dlogits}
        if self.d_conf is not None:
            out[C.DRAFT_CONF] = self.d_conf
        sel = C.selector(self.manifest)
        if sel:
            n, k = self.max_batch * (self.k - 1), sel["top_k"]
            self.h_walk = {C.DRAFT_CANDIDATES: np.zeros((n, k), np.int64), C.DRAFT_SCORES: np.zeros((n, k, k), np.float32)}
            self.d_walk = {name: self._malloc(a.nbytes) for name, a in self.h_walk.items()}
            out |= self.d_walk
        return out

    def draft_walk_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """DFlash 2: the last draft_block call's candidates [n, K-1, k] and walk scores [n, K-1, k, k]."""
        m = n * (self.k - 1)
        for name, a in self.h_walk.items():
            self._d2h(a[:m], self.d_walk[name])
        self._sync()
        cand, scores = self.h_walk[C.DRAFT_CANDIDATES], self.h_walk[C.DRAFT_SCORES]
        return cand[:m].reshape(n, self.k - 1, -1), scores[:m].reshape(n, self.k - 1, *scores.shape[1:])

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        cudart = getattr(self, "cudart", None)
        if cudart is None:
            return
        if getattr(self, "engines", None) is not None:
            self.engines.close()
        for ptr in self._allocs:
            cudart.cudaFree(ptr)
        self._allocs = []
        if getattr(self, "stream", None) is not None:
            cudart.cudaStreamDestroy(self.stream)
            self.stream = None

    @property
    def provider(self) -> str:
        return f"tensorrt {self.trt.__version__} ({self.record.get('precision')}, {self.gpu})"
