"""ONNX Runtime backend: the sessions of one exported directory (runtime/ort/sessions.py), and
what a sequence, or several rows of sequences, owns: its KV caches, taps and ids, bound in place.

Every tensor a call touches lives in a buffer allocated once at load: the target's and
the drafter's KV caches, the taps of the last target call, the output ids and logits. A
call binds raw pointers into them through IO binding: the valid prefix of a cache as the
`past_*` input, the slots right after it as the `new_*` / `ctx_*` output. ORT writes the new
K/V straight into the cache; nothing is copied and nothing grows with the context but
attention itself. The "ort" attention flavour's target (contract.TARGET_ORT) takes its caches
head-major, [B, Hkv, max_len, D], each bound whole as both past and present:
GroupQueryAttention writes the new rows in place.

Rows (runtime/backend.py's `*_rows`): a backend of one row binds its caches' valid prefix in
place and the new K/V straight after it. Several rows share position-major caches ([layers,
max_len, B, ...], contract.RAGGED): a call over all rows binds their common prefix [P, B] in
place, each row masked to its own length, and the new positions land in a scratch written
into each row at its own length after the call (`row_cache.scatter`: a call's new positions
only, never the cache). A joining row's prefill runs alone; past its first chunk its prefix is
gathered (`row_cache.gather_row`: one row, prefill only).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .. import contract as C, manifest as M
from ..backend import Backend, Draft, TargetOut, check_context_counts, scored_drafts, span
from ..errors import InternalError
from ..hybrid import LinearStates
from ..window import WindowRings
from ..memory import check_cache_memory
from ..names import names_of
from .row_cache import check_batch, gather_row, ring_scatter, scatter
from .sessions import PROVIDERS, Sessions, resolve_provider
from ..shared import ONNX_TYPE, STORAGE


class OrtBackend(Backend):
    """ONNX Runtime sessions + preallocated buffers; see runtime/backend.py for the semantics."""

    forks = True  # the sessions are read-only after load: a fork shares them (and the weights)

    def __init__(
        self,
        directory: str | Path,
        provider: str = "cpu",
        *,
        max_chunk: int = 256,
        threads: int | None = None,
        graph_threads: dict[str, int] | None = None,
        spin: bool = False,
        spin_us: int | None = None,
        drafter: bool = True,
        verify: bool = True,
        low_memory: bool = False,
        release_mapped: bool = True,
        max_batch: int = 1,
    ):
        self.directory = Path(directory)
        self._provider = resolve_provider(provider)
        self.manifest = m = M.load_manifest(self.directory, verify=verify)
        self.names = names_of(m)
        self.max_len = m.max_context
        max_chunk = max(max_chunk, m.block_size)
        self.device = "cpu" if self._provider == PROVIDERS["cpu"] else "cuda"
        if C.max_seq(m):  # hybrid target: one delta-rule chunk per call, states committed on the host
            # (runtime/hybrid.py: numpy buffers, bound as host memory on every provider; a GPU provider
            # copies them in and the increments out each call. Not executed here: no GPU.)
            max_chunk = min(max_chunk, C.max_seq(m))
        self.has_drafter = drafter
        self.max_batch = check_batch(m, max_batch, self.device, self.directory)
        self.parks_rows = self.max_batch > 1  # host caches: a row's prefix copied out and back (runtime/prefix.py)
        check_cache_memory(m, self.max_batch, self.max_len, drafter)
        self.trace: list | None = None  # set to [] to record every bound (name, ptr, shape)
        self._plans: dict[tuple[str, str], tuple] = {}  # (graph, tensor) -> how _bind shapes it
        self.threads, self.spin, self.spin_us = threads, spin, spin_us
        self.graphs = Sessions(self.directory, m, self._provider, max_chunk=max_chunk, device=self.device,
                               threads=threads, graph_threads=graph_threads or {}, spin=spin, drafter=drafter,
                               low_memory=low_memory, release_mapped=release_mapped, spin_us=spin_us)
        self.sessions, self.max_chunk = self.graphs.sessions, self.graphs.max_chunk
        self._alloc_state()

    def fork(self) -> "OrtBackend":
        """Another sequence over the same sessions (one copy of the weights): its own KV
        buffers, taps, ids and IO bindings, lengths at 0. A server slot per fork; ORT runs
        one session from several threads, each on its own binding."""
        other = copy.copy(self)
        other.trace = None
        other._alloc_state()
        other.reset()
        return other

    @property
    def provider(self) -> str:
        return f"onnxruntime:{self._provider}"

    def close(self) -> None:
        self.sessions, self._io, self.graphs = {}, {}, None  # forks keep theirs: a session is freed with its last user
        self._io_target, self._bound = {}, {} if self._bound is not None else None  # the bindings they hold

    # -- binding: a contract tensor to a buffer, in place ------------------------------------

    def _alloc(self, shape: tuple, dtype: str):
        if self.device == "cpu":
            return np.zeros(shape, STORAGE[dtype])
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), STORAGE[dtype], "cuda", 0)

    @staticmethod
    def _ptr(buf) -> int:
        return buf.ctypes.data if isinstance(buf, np.ndarray) else buf.data_ptr()

    def _geometry(self, buf, dtype: str) -> tuple[int, int, object]:
        """(base pointer, bytes per row of axis 1, ORT device) of a buffer, computed once."""
        g = self._geom.get(id(buf))
        if g is None:
            shape = buf.shape if isinstance(buf, np.ndarray) else buf.shape()
            row = int(np.prod(shape[2:])) * np.dtype(STORAGE[dtype]).itemsize
            device = "cpu" if isinstance(buf, np.ndarray) else self.device
            g = self._geom[id(buf)] = (self._ptr(buf), row, ort.OrtDevice.make(device, 0)._get_c_device())
        return g

    def _bind(self, graph: str, name: str, buf, offset_rows: int = 0, **dynamic: int):
        """Bind the contract's tensor `name` of `graph` to `buf`, `offset_rows` rows (axis 1)
        in, in place; its shape from the contract with the dynamic roles given (batch 1).

        Calls the binding's C++ object directly: the Python wrapper costs ~8 us a call,
        which at 4 bindings per layer was several percent of a small model's step. On the CPU
        provider a tensor bound at the same pointer and shape as in the binding's last call is
        not bound again (ORT reads host memory at run time; a GPU provider copies a host input
        when it is bound, so there every call binds).
        """
        plan = self._plans.get((graph, name))
        if plan is None:  # once per tensor: which dims are dynamic (a batch-1 call binds ~40 tensors a round)
            output, dtype, dims = self._specs[graph, name]
            plan = self._plans[graph, name] = (output, dtype, ONNX_TYPE[dtype], list(dims),
                                               [(i, d) for i, d in enumerate(dims) if not isinstance(d, int)])
        output, dtype, onnx_type, shape, dyn = plan
        shape = shape.copy()
        for i, d in dyn:
            shape[i] = dynamic.get(d, 1) if d == C.BATCH else dynamic[d]
        g = self._geom.get(id(buf))
        base, row, device = g if g is not None else self._geometry(buf, dtype)
        ptr = base + offset_rows * row
        raw = self._io[graph]._iobinding
        if self.trace is not None:
            self.trace.append((name, ptr, tuple(shape)))
        if self._bound is not None and self._bound.get((raw, name)) == (ptr, shape):
            return  # bound already, and host memory is read at run time: most of a round's tensors
        (raw.bind_output if output else raw.bind_input)(name, device, onnx_type, shape, ptr)
        if self._bound is not None:
            self._bound[raw, name] = (ptr, shape)

    # -- what a sequence owns, and the calls over one row or several ----------------------

    def _alloc_state(self) -> None:
        """The per-sequence state: KV buffers, taps, ids and the IO bindings.

        Everything else (sessions, shared weights, manifest) is read-only after load, so
        `fork` can hand it to another sequence. Caches of one row are [1, max_len, Hkv, D]
        (the same bytes as the ragged graphs' position-major [max_len, 1, Hkv, D]); of
        max_batch > 1 rows, one position-major array for all layers (`kv_all`), whose valid
        prefix of every row is one view, plus a scratch the new rows land in (`kv_new`).
        """
        m, B = self.manifest, self.max_batch
        self._geom = {}
        self._io = {k: s.io_binding() for k, s in self.sessions.items()}
        self._bound: dict | None = {} if self.device == "cpu" else None  # (binding, tensor) -> (pointer, shape)
        self._io_target: dict = {}  # ort flavour: one binding per cache view (all rows, or row b), bound once
        self._rows = None
        self.ragged = C.ragged(m)

        # every tensor a call binds, from the contract: (is output, dtype, shape with dynamic roles)
        self._specs: dict[tuple[str, str], tuple[bool, str, list]] = {}
        static = C.sizes(m)
        for graph in self.sessions:
            ins, outs = C.io(graph, m)
            for output, tensors in ((False, ins), (True, outs)):
                for t in tensors:
                    dims = [d if d in C.DYNAMIC else static[d] for d in t.dims]
                    self._specs[graph, t.name] = (output, C.dtype(t, m), dims)
        kv_type = C.dtype((C.CACHE_KV if C.flavour(m) == "ort" else C.PAST_KV)[0], m)  # ort: int8 when quantized
        L, Hkv, D, n = m.target_layers, m.target_kv_heads, m.target_head_dim, self.max_len
        self.in_place = C.flavour(m) == "ort"  # head-major cache, past and present one buffer (contract.TARGET_ORT)
        # GroupQueryAttention takes several new tokens with a past at batch > 1 only given each row's
        # count (contract.row_counts); older ort exports verify such rows one call each
        self.verify_per_row = self.in_place and not C.row_counts(m)
        kinds = C.layer_kinds(C.TARGET, m)
        att = [i for i in range(L) if kinds[i] == C.ATTENTION]  # the rest: states, rings or nothing
        self.kv_all = self.ctx_all = None
        self._views, self._flat, self._tail, self._wcache = {}, {}, {}, {}
        self.width = B  # rows a call over all rows carries (set_width: the loop keeps its rows in 0..width-1)
        if self.in_place or B == 1:
            shape = (B, Hkv, n, D) if self.in_place else (1, n, Hkv, D)
            self.kv = [self._alloc(shape, kv_type) if i in att else None for i in range(L) for _ in (0, 1)]
        else:  # views held in lists: _bind caches each buffer's geometry by id
            slot = {i: j for j, i in enumerate(att)}
            self._kv_slot = [2 * slot[i] + e if i in slot else None for i in range(L) for e in (0, 1)]
            self._flat["kv"], self._tail["kv"] = np.zeros((2 * len(att), n * B * Hkv * D), STORAGE[kv_type]), (Hkv, D)
            self.kv_new = np.zeros((2 * len(att), B * self.max_chunk * Hkv * D), STORAGE[kv_type])
            self._row_kv = np.zeros((2 * len(att), n * Hkv * D), STORAGE[kv_type])  # one row's prefix, gathered
            self._views = {k: list(getattr(self, k)) for k in ("kv_new", "_row_kv")}
        self.states = LinearStates(m, self.max_chunk, B) if m.linear_layers else None
        self.rings = WindowRings(m, self.max_chunk, B) if C.SLIDING in kinds else None
        self.lengths_in = np.zeros(B, np.int32), np.zeros((), np.int32)  # ort flavour: seqlens_k, total_sequence_length
        width = static[C.TAPS_WIDTH]
        self.taps = self._alloc((B, self.max_chunk, width), C.dtype(C.tensor(C.TARGET, C.TAPS, m), m))
        K, V = m.block_size, m.vocab_size
        self.logits = np.empty((B, K, V), np.float32)  # host: verify logits when sampling
        self.next_ids = np.empty((B, self.max_chunk), np.int64)
        self.ids = np.empty((B, self.max_chunk), np.int64)
        self.positions = np.arange(self.max_len + K, dtype=np.int64)[None]
        self.row_pos = np.empty((B, self.max_chunk), np.int64)  # several rows' positions, per call
        self.picks = np.empty((B, self.max_chunk), np.int64)  # logits_index
        self.past_lengths = np.zeros(B, np.int64)
        self._logits_scratch = self.logits if self.device == "cpu" else self._alloc((B, K, V), "float32")
        self._last_seq = 0  # S of the last target call (its taps are [R, S] for draft_context)
        if self.has_drafter:
            dL, dH, dD = m.draft_layers, m.draft_kv_heads, m.draft_head_dim
            ctx_type = C.dtype(C.CTX_KV[0], m)
            self.ring = C.ring(m)  # the context cache's slots: a ring (runtime/ort/row_cache.py), or one per position
            n = self._ctx_len = min(self.ring or n, n)
            if B == 1:
                self.ctx = [self._alloc((1, n, dH, dD), ctx_type) for _ in range(2 * dL)]
            else:
                self._flat["ctx"], self._tail["ctx"] = np.zeros((2 * dL, n * B * dH * dD), STORAGE[ctx_type]), (dH, dD)
                self._row_ctx = np.zeros((2 * dL, n * dH * dD), STORAGE[ctx_type])
            if B > 1 or self.ring:  # new context K/V land here, then in each row's slots
                self.ctx_new = np.zeros((2 * dL, B * self.max_chunk * dH * dD), STORAGE[ctx_type])
                self._views.update({k: list(getattr(self, k)) for k in ("ctx_new", "_row_ctx") if hasattr(self, k)})
            self.block_ids = np.full((B, K), m.mask_token_id, np.int64)
            self.ctx_lengths_in = np.zeros(B, np.int64)
            self.draft_ids = np.empty((B, K - 1), np.int64)
            self._draft_index = np.arange(K - 1, dtype=np.int64)  # draft_index: a prefix of it, 0..n-1
            self._scored = K - 1  # drafts the last draft_block call scored
            self._draft_logits = self._alloc((B, K - 1, C.draft_vocab_size(m)), "float32")
            self._conf = np.empty((B, K - 1), np.float32)
            if C.selector(m):  # DFlash 2: candidates and walk scores (runtime/walk.py)
                k = int(C.selector(m)["top_k"])
                self._cand, self._scores = np.empty((B, K - 1, k), np.int64), self._alloc((B, K - 1, k, k), "float32")
        self._use_width()

    def _wide(self, key: str, w: int) -> tuple[np.ndarray, list]:
        """The position-major cache `key` laid out for w rows: [layers, max_len, w, ...] and one
        view per layer (made once per width: _bind caches geometry by id)."""
        c = self._wcache.get((key, w))
        if c is None:
            flat, tail = self._flat[key], self._tail[key]
            n = self._ctx_len if key == "ctx" else self.max_len
            arr = flat[:, : n * w * int(np.prod(tail))].reshape(flat.shape[0], n, w, *tail)
            c = self._wcache[key, w] = (arr, list(arr))
        return c

    def _use_width(self) -> None:
        if "kv" in self._flat:
            self.kv_all, views = self._wide("kv", self.width)
            self.kv = [None if j is None else views[j] for j in self._kv_slot]
        if "ctx" in self._flat:
            self.ctx_all, self.ctx = self._wide("ctx", self.width)

    def _relayout(self, keep: int, old: int) -> None:
        """Position-major caches: the kept rows' valid prefixes copied into the layout for
        `width`; batch-major buffers (the ort flavour's, states) need nothing."""
        for key, lens in (("kv", self.lengths), ("ctx", self.ctx_lengths)):
            p = int(lens[:keep].max()) if keep and key in self._flat else 0
            if p:
                rows = self._wide(key, old)[0][:, :p, :keep].copy()
                self._wide(key, self.width)[0][:, :p, :keep] = rows
        self._use_width()

    def _move_caches(self, src: int, dst: int) -> None:
        p, pc = int(self.lengths[src]), int(self.ctx_lengths[src])
        if self.in_place:
            for buf in (b for b in self.kv if b is not None):
                buf[dst, :, :p] = buf[src, :, :p]
        elif self.kv_all is not None:
            self.kv_all[:, :p, dst] = self.kv_all[:, :p, src]
        if self.ctx_all is not None:
            self.ctx_all[:, :pc, dst] = self.ctx_all[:, :pc, src]

    def save_row(self, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Row b's valid caches: target K/V [2 x attention layers, p, Hkv, D] (position-major
        caches) or [2 x attention layers, Hkv, p, D] (the ort flavour's head-major buffers)."""
        p, pc = int(self.lengths[b]), int(self.ctx_lengths[b])
        if self.in_place:
            kv = np.stack([buf[b, :, :p] for buf in self.kv if buf is not None])
        else:
            kv = self.kv_all[:, :p, b].copy()
        return kv, self.ctx_all[:, :pc, b].copy() if self.has_drafter and pc else None

    def load_row(self, b: int, kv: np.ndarray, ctx: np.ndarray | None, n: int, ctx_n: int) -> None:
        self._layout()  # a width set at this round boundary is laid out at the next call: now, before the write
        self.reset_row(b)
        if self.in_place:
            for j, buf in enumerate(x for x in self.kv if x is not None):
                buf[b, :, :n] = kv[j, :, :n]
        else:
            self.kv_all[:, :n, b] = kv[:, :n]
        if ctx_n:
            self.ctx_all[:, :ctx_n, b] = ctx[:, :ctx_n]
        self.lengths[b], self.ctx_lengths[b] = n, ctx_n

    def _target_io(self, row: int | tuple[int, int] | None):
        """The ort flavour's target binding for row b, or rows (b, n): b..b+n-1. Its cache buffers
        (past and present, the rows' slices) are bound once, when it is made; they never move
        and the binding keeps them across runs (rebinding 4 per layer cost ~0.1 ms a call at
        6 layers). Not the lengths: binding copies a host input the kernel wants on the GPU at
        bind time, so they are bound after their values are written, every call."""
        io = self._io_target.get(row)
        if io is not None:
            return io
        io = self._io_target[row] = self._io[C.TARGET] if row in (None, 0) and self.max_batch == 1 \
            else self.sessions[C.TARGET].io_binding()
        saved, self._io[C.TARGET] = self._io[C.TARGET], io
        (first, rows) = row if isinstance(row, tuple) else (row, 1)
        at = first * self.manifest.target_kv_heads
        for i in range(self.manifest.target_layers):
            k, v = self.kv[2 * i], self.kv[2 * i + 1]
            for name, buf in ((self.names.past_key[i], k), (self.names.past_value[i], v), (self.names.present_key[i], k),
                              (self.names.present_value[i], v)):
                self._bind(C.TARGET, name, buf, at, batch=rows)
        self._io[C.TARGET] = saved
        return io

    def _target(self, ids: np.ndarray, want_logits: bool = False) -> TargetOut:
        res = self.target_rows([0], np.asarray(ids, np.int64)[None], [len(ids)], None, want_logits)
        return TargetOut(res.next_ids[0], None if res.logits is None else res.logits[0])

    def draft_context(self, n: int) -> None:
        self.draft_context_rows([0], [n])

    def draft_block(self, anchor: int, scored: int | None = None) -> Draft:
        ids, conf = self.draft_block_rows([0], [anchor], scored)
        return Draft(ids[0], None if conf is None else conf[0])

    def target_rows(self, rows, ids, counts, picks=None, want_logits=False) -> TargetOut:
        self._layout()
        R, S = ids.shape
        if not 1 <= S <= self.max_chunk:
            raise InternalError(f"target call with {S} tokens (1..{self.max_chunk})")
        self.check_room(rows, counts)
        if self.verify_per_row and R > 1 and S > 1:  # GroupQueryAttention: several new tokens with a past, one row a call
            return self._target_each(rows, ids, counts, picks, want_logits)
        return self._target_call(rows, ids, counts, picks, want_logits, 0)

    def _target_each(self, rows, ids, counts, picks, want_logits) -> TargetOut:
        """An older ort export's verify of several rows (no Manifest.row_counts): GroupQueryAttention
        takes several new tokens with a past at batch 1 only without each row's count, so a row verifying more than its anchor runs alone; rows
        verifying one position (plain rows of a drafted round, a row at its last token) run
        together, consecutive rows in one call as a plain step does. Taps land where a call over
        all rows would write them ([R, S]: row r's at r * S), for draft_context_rows."""
        R, S = ids.shape
        N = S if picks is None else picks.shape[1]
        next_ids, logits = np.zeros((R, N), np.int64), np.zeros((R, N, self.manifest.vocab_size), np.float32) if want_logits else None
        counts = np.asarray(counts)
        runs, r = [], 0  # (first row, rows): consecutive one-position rows together, other rows alone
        while r < R:
            n = 1
            while counts[r] == 1 and r + n < R and counts[r + n] == 1 and rows[r + n] == rows[r] + n:
                n += 1
            runs.append((r, n))
            r += n
        runs.sort(key=lambda run: run[1] == 1)  # the joint calls first: their taps land at [0, n), copied out
        flat, joint = self.taps.reshape(-1, self.taps.shape[-1]), []
        for r, n in runs:
            c = int(counts[r])
            if c == 0:  # an idle row
                continue
            if n > 1:
                res = self._target_call(rows[r : r + n], ids[r : r + n, :1], counts[r : r + n], np.zeros((n, N), np.int64),
                                        want_logits, 0)
                joint.append((r, flat[:n].copy()))
            else:
                at = np.minimum(np.arange(N) if picks is None else picks[r], c - 1)[None]
                res = self._target_call([rows[r]], ids[r : r + 1, :c], [c], at, want_logits, r * S)
            next_ids[r : r + n] = res.next_ids
            if want_logits:
                logits[r : r + n] = res.logits
        for r, taps in joint:
            flat[r * S : r * S + len(taps) * S : S] = taps
        self._last_seq = S
        return TargetOut(next_ids, logits)

    def _target_call(self, rows, ids, counts, picks, want_logits, taps_at: int) -> TargetOut:
        """One session run over `rows` (one row, or all); taps written `taps_at` positions in."""
        m, g, lengths, B = self.manifest, C.TARGET, self.lengths, self.max_batch
        R, S = ids.shape
        one, b0, sl = R == 1, rows[0], span(rows)
        P = int(lengths[b0]) if one else int(lengths[sl].max())
        N = S if picks is None or not self.ragged else picks.shape[1]
        if self.in_place and list(rows) != list(range(b0, b0 + R)):
            raise InternalError(f"the ort flavour's target call takes consecutive rows, not {list(rows)}")
        io = self._target_io(b0 if one else (b0, R)) if self.in_place else self._io[g]
        self._io[g], saved = io, self._io[g]
        self.ids.ravel()[: R * S] = np.asarray(ids).ravel()  # a call's [R, S] from the buffer's start
        self._bind(g, C.INPUT_IDS, self.ids, batch=R, seq=S)
        if one:
            self._bind(g, C.POSITION_IDS, self.positions, P, seq=S)
        else:
            pos = self.row_pos.ravel()[: R * S].reshape(R, S)
            np.add(lengths[sl, None], np.arange(S), out=pos)
            self._bind(g, C.POSITION_IDS, self.row_pos, batch=R, seq=S)
        if self.ragged:
            pick = self.picks.ravel()[: R * N].reshape(R, N)
            pick[:] = np.arange(S) if picks is None else picks
            self._bind(g, C.LOGITS_INDEX, self.picks, batch=R, picks=N)
        if self.in_place:  # GroupQueryAttention writes rows [P_b, P_b + S) of the buffers it reads
            seqlens, total = self.lengths_in
            if C.row_counts(self.manifest) and not one:  # each row its own count (idle: 0), the rest right padding
                seqlens[:R] = np.maximum(lengths[sl] + np.asarray(counts) - 1, 0)
                total[()] = min(P + S, self.max_len)  # an upper bound here: a short row's padding writes nothing
            else:
                seqlens[:R] = lengths[sl] + S - 1
                total[()] = P + S
            self._bind(g, C.SEQLENS_K, seqlens, batch=R)
            self._bind(g, C.TOTAL_LEN, total)
        else:
            if self.ragged:
                self.past_lengths[:R] = lengths[sl]
                self._bind(g, C.PAST_LENGTHS, self.past_lengths, batch=R)
            self._bind_target_caches(rows, P, S)
        self._bind(g, C.TAPS, self.taps, taps_at, batch=R, seq=S)
        self._bind(g, C.NEXT_IDS, self.next_ids, batch=R, picks=N, seq=N)
        big = R * N > B * m.block_size
        if big:  # a prefill chunk's every position: ORT allocates its logits
            io.bind_output(C.LOGITS, "cpu" if want_logits else self.device)
            if self._bound is not None:
                self._bound.pop((io._iobinding, C.LOGITS), None)
        else:
            self._bind(g, C.LOGITS, self.logits if want_logits else self._logits_scratch, batch=R, picks=N, seq=N)
        self.sessions[g].run_with_iobinding(io)
        self._io[g] = saved
        if self.kv_all is not None and not self.in_place and self.width > 1:  # width 1: written in place
            scatter(self.kv_all, self.kv_new, rows, lengths, S, counts)
        self.pending[sl] = counts
        self._last_seq = S
        next_ids = self.next_ids.ravel()[: R * N].reshape(R, N)
        logits = None
        if want_logits:
            logits = io.get_outputs()[-1].numpy() if big else self.logits.ravel()[: R * N * m.vocab_size].reshape(R, N, -1)
        if not self.ragged and picks is not None:  # older graphs compute every position
            next_ids, logits = next_ids[:, picks[0]], None if logits is None else logits[:, picks[0]]
        return TargetOut(next_ids, logits)

    def _bind_target_caches(self, rows, P: int, S: int) -> None:
        """Past K/V (and linear states) of `rows` in; the new positions' outputs out. One row of
        a one-row backend: its cache prefix, the new K/V straight after it. All rows: their
        position-major prefix [P, B]; the new K/V to kv_new, written per row after the run
        (`row_cache.scatter`). One row of several: its prefix gathered (prefill chunks, reuse)."""
        m, g, R, B = self.manifest, C.TARGET, len(rows), self.max_batch
        if self.states is not None:
            self.states.layout(R, S)
        if self.rings is not None:
            self.rings.layout(R, S)
        at = rows[0] if R == 1 else 0
        kinds = C.layer_kinds(g, m)
        gathered = R == 1 and self.width > 1 and P > 0  # width 1: the one row's prefix is contiguous, bound in place
        if gathered:
            gather_row(self.kv_all, self._row_kv, at, P)
        for i in range(m.target_layers):
            if m.is_linear(i):  # committed states in, per-position outputs to commit out
                buf = self.states.buf
                for name in (self.names.conv_state[i], self.names.rec_state[i]):
                    self._bind(g, name, buf[name], at * buf[name].shape[1], batch=R)
                for name in (self.names.new_conv[i], *self.names.delta[i]):
                    self._bind(g, name, self.states.flat[name], batch=R, seq=S)
                continue
            if kinds[i] == C.SHARED:  # attends to an earlier layer's K/V inside the graph
                continue
            if kinds[i] == C.SLIDING:  # the rows' rings (one row: its written slots), new K/V to commit
                rings, slots = self.rings, self.rings.bound(self.lengths[at]) if R == 1 else self.rings.ring
                for past, new in ((self.names.past_key[i], self.names.new_key[i]),
                                  (self.names.past_value[i], self.names.new_value[i])):
                    self._bind(g, past, rings.buf[past], at * rings.ring, batch=R, window_past=slots)
                    self._bind(g, new, rings.flat[new], batch=R, seq=S)
                continue
            if B == 1 or self.width == 1:  # one row's cache, contiguous: the new K/V go straight after its prefix
                k, v = self.kv[2 * i], self.kv[2 * i + 1]
                self._bind(g, self.names.past_key[i], k, past=P)
                self._bind(g, self.names.past_value[i], v, past=P)
                self._bind(g, self.names.new_key[i], k, P, seq=S)
                self._bind(g, self.names.new_value[i], v, P, seq=S)
                continue
            for e, (past, new) in enumerate(((self.names.past_key[i], self.names.new_key[i]), (self.names.past_value[i], self.names.new_value[i]))):
                j = self._kv_slot[2 * i + e]
                self._bind(g, past, self._views["_row_kv"][j] if gathered else self.kv[2 * i + e], batch=R, past=P)
                self._bind(g, new, self._views["kv_new"][j], batch=R, seq=S)

    def draft_context_rows(self, rows, n) -> None:
        self._layout()
        m, g, R, B = self.manifest, C.DRAFT_CONTEXT, len(rows), self.max_batch
        lengths = self.ctx_lengths
        c = int(n[0]) if R == 1 else self._last_seq  # several rows: each computes the whole last call
        if c == 0:
            return
        check_context_counts(rows, n, self._last_seq, lengths, self.max_len)
        P, sl = int(lengths[rows[0]]), span(rows)
        self._bind(g, C.TAPS, self.taps, batch=R, ctx=c)
        if R == 1:
            self._bind(g, C.CTX_POSITION_IDS, self.positions, P, ctx=c)
        else:
            pos = self.row_pos.ravel()[: R * c].reshape(R, c)
            np.add(lengths[sl, None], np.arange(c), out=pos)
            self._bind(g, C.CTX_POSITION_IDS, self.row_pos, batch=R, ctx=c)
        for j in range(2 * m.draft_layers):
            name = self.names.ctx_key[j // 2] if j % 2 == 0 else self.names.ctx_value[j // 2]
            if (B == 1 or self.width == 1) and not self.ring:
                self._bind(g, name, self.ctx[j], P, ctx=c)
            else:
                self._bind(g, name, self._views["ctx_new"][j], batch=R, ctx=c)
        self.sessions[g].run_with_iobinding(self._io[g])
        if self.ring:
            ring_scatter(self.ctx, self.ctx_new, rows, lengths, c, n, self.ring)
        elif B > 1 and self.width > 1:
            scatter(self.ctx_all, self.ctx_new, rows, lengths, c, n)
        lengths[sl] += c if R == 1 else np.asarray(n)  # one row: its count, an int (no array built)

    def draft_block_rows(self, rows, anchors, scored=None):
        self._layout()
        m, g, R, K = self.manifest, C.DRAFT_BLOCK, len(rows), self.manifest.block_size
        n = self._scored = scored_drafts(m, scored)
        lengths = self.ctx_lengths
        sl = span(rows)
        P = min(int(lengths[rows[0]]) if R == 1 else int(lengths[sl].max()), self._ctx_len)  # a ring: every slot
        self.block_ids[:R, 0] = anchors
        self._bind(g, C.BLOCK_IDS, self.block_ids, batch=R)
        if R == 1:  # the block's positions start at the row's context length (P: the slots bound, a ring's at most)
            self._bind(g, C.BLOCK_POSITION_IDS, self.positions, int(lengths[rows[0]]))
        else:
            pos = self.row_pos.ravel()[: R * K].reshape(R, K)
            np.add(lengths[sl, None], np.arange(K), out=pos)
            self._bind(g, C.BLOCK_POSITION_IDS, self.row_pos, batch=R)
        if self.ragged:
            self.ctx_lengths_in[:R] = lengths[sl]
            self._bind(g, C.CTX_LENGTHS, self.ctx_lengths_in, batch=R)
        gathered = R == 1 and self.width > 1 and P > 0  # width 1: the one row's prefix is contiguous, bound in place
        if gathered:
            gather_row(self.ctx_all, self._row_ctx, rows[0], P)
        for j in range(2 * m.draft_layers):
            name = self.names.past_ctx_key[j // 2] if j % 2 == 0 else self.names.past_ctx_value[j // 2]
            self._bind(g, name, self._views["_row_ctx"][j] if gathered else self.ctx[j], batch=R, past_ctx=P)
        if C.draft_index(m):  # the outputs are [R, n]: the first R * n elements of each buffer
            self._bind(g, C.DRAFT_INDEX, self._draft_index, scored=n)
        self._bind(g, C.DRAFT_IDS, self.draft_ids, batch=R, scored=n)
        self._bind(g, C.DRAFT_LOGITS, self._draft_logits, batch=R, scored=n)
        self._bind(g, C.DRAFT_CONF, self._conf, batch=R, scored=n)
        if C.selector(m):
            self._bind(g, C.DRAFT_CANDIDATES, self._cand, batch=R)
            self._bind(g, C.DRAFT_SCORES, self._scores, batch=R)
        self.sessions[g].run_with_iobinding(self._io[g])
        return self.draft_ids.reshape(-1)[: R * n].reshape(R, n), self._conf.reshape(-1)[: R * n].reshape(R, n)

    def draft_walk_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """DFlash 2: the last `draft_block_rows` call's candidates [n, K-1, k] and walk scores [n, K-1, k, k]."""
        x = self._scores
        return self._cand[:n], (x if isinstance(x, np.ndarray) else x.numpy())[:n]

    def draft_logits_rows(self, n: int) -> np.ndarray:
        x = self._draft_logits  # host memory on the CPU provider; a GPU provider's is copied here
        x, s = (x if isinstance(x, np.ndarray) else x.numpy()), self._scored
        return x.reshape(-1)[: n * s * x.shape[-1]].reshape(n, s, x.shape[-1])

    # -- plain steps between drafted rounds (runtime/controller.py) -------------------------

    def last_taps(self, rows: int) -> np.ndarray | None:
        """A host copy of the last one-position call's taps [rows, T*H] (None off the CPU)."""
        return self.taps.reshape(-1, self.taps.shape[-1])[:rows].copy() if isinstance(self.taps, np.ndarray) else None

    def context_from_taps(self, b: int, taps: np.ndarray) -> None:
        """Row b's drafter context gains the positions of `taps` [n, T*H] (kept by `last_taps`)."""
        flat = self.taps.reshape(-1, self.taps.shape[-1])
        for i in range(0, len(taps), len(flat)):
            piece = taps[i : i + len(flat)]
            flat[: len(piece)] = piece
            self._last_seq = len(piece)  # what draft_context_rows may take
            self.draft_context_rows([b], [len(piece)])
