"""ONNX Runtime backend: three sessions over one exported directory, KV caches bound in place.

Every tensor a call touches lives in a buffer allocated once at load: the target's and
the drafter's KV caches ([1, max_len, Hkv, D] per layer), the taps of the last target
call, the output ids and logits. A call binds raw pointers into them through IO binding:
the valid prefix of a cache as the `past_*` input, the slots right after it as the
`new_*` / `ctx_*` output. ORT writes the new K/V straight into the cache; nothing is
copied and nothing grows with the context but attention itself. The "ort" attention
flavour's target (contract.TARGET_ORT) takes its caches head-major, [1, Hkv, max_len, D],
each bound whole as both past and present: GroupQueryAttention writes the new rows in place.

The weights several graphs hold (embedding and LM head; the drafter's K/V projections)
are memory-mapped once from shared.data, where the manifest's `shared` table says they
are, and handed to every session whose graph holds them with `add_initializer`: one copy
in memory, used in place by all. The embedding is read in place; the LM head
is prepacked per session (one packed copy each, the fast path; a tied head is read
transposed from the table: those sessions skip constant folding so that ORT packs it
straight from the table instead of also keeping a folded transposed copy, see
docs/real_sizes.md); `low_memory=True` turns prepacking off too so the one copy is all
there is, at the price of slower GEMMs (README, Runtime).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import contract as C, manifest as M
from .backend import Backend, TargetOut
from .errors import DFlashError
from .hybrid import LinearStates
from .memory import check_cache_memory

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
# TensorProto.DataType; uint8: weight-only quantized tensors (MatMulNBits, docs/quantization.md); int32: the
# ort attention flavour's lengths (contract.TARGET_ORT)
ONNX_TYPE = {"float32": 1, "float16": 10, "bfloat16": 16, "int64": 7, "uint8": 2, "int32": 6}
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int64": np.int64, "uint8": np.uint8,
           "int32": np.int32}


def available_providers() -> list[str]:
    have = set(ort.get_available_providers())
    return [k for k, v in PROVIDERS.items() if v in have]


def resolve_provider(name: str) -> str:
    """'cpu' | 'cuda' -> the ORT provider name, or a one-line error listing what exists."""
    have = ", ".join(available_providers())
    if name not in PROVIDERS:
        raise DFlashError(f"unknown provider {name!r}; available: {have}")
    if PROVIDERS[name] not in ort.get_available_providers():
        raise DFlashError(
            f"provider {name!r} is not available in this onnxruntime {ort.__version__} (available: {have}); "
            "for cuda install the gpu extra (onnxruntime-gpu)"
        )
    return PROVIDERS[name]


# -- shared weights, memory-mapped from the manifest's table ----------------------------


def shared_weights(directory: Path, m: M.Manifest) -> dict[str, tuple[np.ndarray, int]]:
    """name -> (array over its bytes in shared.data, onnx element type), one array per
    distinct (file, offset): tied names share it. Mapped copy-on-write: the pages are the
    file's (no copy at load); nothing is ever written back."""
    maps: dict[str, np.memmap] = {}
    seen: dict[tuple, np.ndarray] = {}
    out = {}
    for name, t in m.shared.items():
        path = (directory / t.file).resolve()
        if directory.resolve() not in path.parents:
            raise DFlashError(f"{directory}: shared weight {name} points outside the directory ({t.file}); re-export it")
        if t.dtype not in STORAGE:
            raise DFlashError(f"{directory}: shared weight {name} has unsupported dtype {t.dtype}; re-export it")
        mm = maps.get(t.file)
        if mm is None:
            mm = maps[t.file] = np.memmap(path, np.uint8, mode="c")
        dtype = np.dtype(STORAGE[t.dtype])
        if t.length != int(np.prod(t.shape)) * dtype.itemsize or t.offset + t.length > mm.size:
            raise DFlashError(f"{directory}: shared weight {name} does not fit {t.file}; re-export the directory")
        key = (t.file, t.offset)
        if key not in seen:
            seen[key] = mm[t.offset : t.offset + t.length].view(dtype).reshape(t.shape)
        out[name] = (seen[key], ONNX_TYPE[t.dtype])
    return out


def tied_head_graphs(m: M.Manifest, shared: dict) -> set[str]:
    """Graphs whose LM head is the fp32 embedding table itself (tied, read transposed): these
    are built without ORT's constant folding (fp16 needs it: CPU MatMul casts folded to fp32)."""
    embed, head = C.SHARED_INITIALIZERS
    if m.dtype != "fp32" or head not in shared or embed not in shared or shared[head][0] is not shared[embed][0]:
        return set()
    return set(m.shared[head].graphs)


# -- rows of a batch -------------------------------------------------------------------


def check_batch(m: M.Manifest, max_batch: int, device: str, directory) -> int:
    """max_batch, or one line on why this export or provider cannot run that many rows."""
    if max_batch < 1:
        raise DFlashError(f"--batch must be at least 1 (got {max_batch})")
    if max_batch > 1 and not C.ragged(m):
        raise DFlashError(f"{directory} was exported before batched decoding (batch 1 only); re-export it with this "
                          "dflash-export to run --batch > 1")
    if max_batch > 1 and device != "cpu":
        raise DFlashError("--batch > 1 runs on the CPU provider here (the batched caches are host arrays); "
                          "use --provider cpu or --batch 1")
    return max_batch


def _scatter(cache: np.ndarray, new: np.ndarray, rows, lengths: np.ndarray, s: int, counts) -> None:
    """Write each row's new positions ([layers, R, s, ...] in `new`) into the position-major
    cache [layers, max_len, B, ...] at that row's own length: counts[r] of them."""
    L, n = cache.shape[0], cache.shape[1]
    view = new[:, : len(rows) * s * int(np.prod(cache.shape[3:]))].reshape(L, len(rows), s, *cache.shape[3:])
    for r, b in enumerate(rows):
        at = int(lengths[b])
        w = min(int(counts[r]), n - at)
        cache[:, at : at + w, b] = view[:, r, :w]


def _gather_row(cache: np.ndarray, out: np.ndarray, b: int, p: int) -> None:
    """Row b's first p positions of every layer, contiguous in out [layers, p, 1, ...]."""
    out[:, : p * int(np.prod(cache.shape[3:]))].reshape(cache.shape[0], p, *cache.shape[3:])[:] = cache[:, :p, b]


# -- the backend -----------------------------------------------------------------------


class OrtBackend(Backend):
    """ONNX Runtime sessions + preallocated buffers; see runtime/backend.py for the semantics."""

    def __init__(
        self,
        directory: str | Path,
        provider: str = "cpu",
        *,
        max_chunk: int = 256,
        threads: int | None = None,
        graph_threads: dict[str, int] | None = None,
        spin: bool = False,
        drafter: bool = True,
        verify: bool = True,
        low_memory: bool = False,
        release_mapped: bool = True,
        max_batch: int = 1,
    ):
        self.directory = Path(directory)
        self._provider = resolve_provider(provider)
        self.manifest = m = M.load_manifest(self.directory, verify=verify)
        self.max_len = m.max_context
        self.max_chunk = max(max_chunk, m.block_size)
        self.device = "cpu" if self._provider == PROVIDERS["cpu"] else "cuda"
        if C.max_seq(m):  # hybrid target: one delta-rule chunk per call, states committed on the host
            # (runtime/hybrid.py: numpy buffers, bound as host memory on every provider; a GPU provider
            # copies them in and the increments out each call. Not executed here: no GPU.)
            self.max_chunk = min(self.max_chunk, C.max_seq(m))
        self.has_drafter = drafter
        self.max_batch = check_batch(m, max_batch, self.device, self.directory)
        check_cache_memory(m, self.max_batch, self.max_len, drafter)
        self.low_memory = low_memory
        self.trace: list | None = None  # set to [] to record every bound (name, ptr, shape)
        self._geom: dict[int, tuple] = {}  # id(buffer) -> (pointer, row bytes, device), see _bind

        # one copy of the shared weights, used in place by every session whose graph holds them
        self._shared = shared_weights(self.directory, m)
        self._shared_ov = {
            n: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, t) for n, (a, t) in self._shared.items()
        }
        self.threads, self.spin = threads, spin  # threads None: ORT's own default (one per core)
        self.graph_threads = dict(graph_threads or {})  # per graph counts over `threads` (runtime.json)
        self._tied_head_graphs = tied_head_graphs(m, self._shared) if self.device == "cpu" else set()
        self.sessions = {}
        for graph in (C.TARGET, C.DRAFT_CONTEXT, C.DRAFT_BLOCK) if drafter else (C.TARGET,):
            self.sessions[graph] = self._session(graph)
            if release_mapped:  # before the next session adds its own memory to the peak
                self._release_mapped(last=graph == C.DRAFT_BLOCK or not drafter)
        self._alloc_state()

    def _release_mapped(self, last: bool) -> None:
        """Drop the pages of shared.data that building a session read (ORT prepacks the LM
        head into its own buffer; the mapped original stays resident, a second copy in RSS).
        The mapping stays valid. Once the last session is built, the mapping is marked random
        access and the file's pages leave the page cache, so that the embedding's Gather
        faults back a page per row it reads: otherwise each fault maps the large page-cache
        folio around it (the build read the file sequentially), and a 512-token prompt of
        random ids pulled 315 MB back in. Copy-on-write pages are never written: nothing is lost."""
        import mmap
        import os

        arrays = [a for a, _ in self._shared.values()]
        maps = {id(m): m for m in (getattr(a, "_mmap", None) for a in arrays) if m is not None}
        for m in maps.values():
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):  # Linux/macOS; elsewhere a no-op
                m.madvise(mmap.MADV_DONTNEED)
                if last and hasattr(mmap, "MADV_RANDOM"):
                    m.madvise(mmap.MADV_RANDOM)
        files = {str(f) for f in (getattr(a, "filename", None) for a in arrays) if f}
        for f in files if last and hasattr(os, "posix_fadvise") else ():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages only: a hint, never a loss
            finally:
                os.close(fd)

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
        kv_type = C.dtype(C.PAST_KV[0], m)
        L, Hkv, D, n = m.target_layers, m.target_kv_heads, m.target_head_dim, self.max_len
        self.in_place = C.flavour(m) == "ort"  # head-major cache, past and present one buffer (contract.TARGET_ORT)
        att = [i for i in range(L) if not m.is_linear(i)]
        self.kv_all = self.ctx_all = None
        self._views: dict[str, list] = {}
        if self.in_place or B == 1:
            shape = (B, Hkv, n, D) if self.in_place else (1, n, Hkv, D)
            self.kv = [None if m.is_linear(i) else self._alloc(shape, kv_type) for i in range(L) for _ in (0, 1)]
        else:  # views held in lists: _bind caches each buffer's geometry by id
            slot = {i: j for j, i in enumerate(att)}
            self._kv_slot = [None if m.is_linear(i) else 2 * slot[i] + e for i in range(L) for e in (0, 1)]
            self.kv_all = np.zeros((2 * len(att), n, B, Hkv, D), STORAGE[kv_type])
            self.kv_new = np.zeros((2 * len(att), B * self.max_chunk * Hkv * D), STORAGE[kv_type])
            self._row_kv = np.zeros((2 * len(att), n * Hkv * D), STORAGE[kv_type])  # one row's prefix, gathered
            self._views = {k: list(getattr(self, k)) for k in ("kv_all", "kv_new", "_row_kv")}
            self.kv = [None if j is None else self._views["kv_all"][j] for j in self._kv_slot]
        self.states = LinearStates(m, self.max_chunk, B) if m.linear_layers else None
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
            if B == 1:
                self.ctx = [self._alloc((1, n, dH, dD), ctx_type) for _ in range(2 * dL)]
            else:
                self.ctx_all = np.zeros((2 * dL, n, B, dH, dD), STORAGE[ctx_type])
                self.ctx_new = np.zeros((2 * dL, B * self.max_chunk * dH * dD), STORAGE[ctx_type])
                self._row_ctx = np.zeros((2 * dL, n * dH * dD), STORAGE[ctx_type])
                self._views.update({k: list(getattr(self, k)) for k in ("ctx_all", "ctx_new", "_row_ctx")})
                self.ctx = self._views["ctx_all"]
            self.block_ids = np.full((B, K), m.mask_token_id, np.int64)
            self.ctx_lengths_in = np.zeros(B, np.int64)
            self.draft_ids = np.empty((B, K - 1), np.int64)
            self._draft_logits = self._alloc((B, K - 1, C.draft_vocab_size(m)), "float32")
            self._conf = np.empty((B, K - 1), np.float32)

    def fork(self) -> "OrtBackend":
        """Another sequence over the same sessions (one copy of the weights): its own KV
        buffers, taps, ids and IO bindings, lengths at 0. A server slot per fork; ORT runs
        one session from several threads, each on its own binding."""
        other = copy.copy(self)
        other.trace = None
        other._alloc_state()
        other.reset()
        return other

    # -- setup ---------------------------------------------------------------------------

    def _session(self, graph: str) -> ort.InferenceSession:
        opts = ort.SessionOptions()
        threads = self.graph_threads.get(graph, self.threads)
        if threads:
            opts.intra_op_num_threads = threads
        # spinning workers burn the other vCPU between calls: ~2x slower calls on shared machines
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
        path = self.directory / self.manifest.graphs[graph].file
        for name, t in self.manifest.shared.items():
            if graph in t.graphs:
                opts.add_initializer(name, self._shared_ov[name])
        kwargs = {}
        if self.low_memory:  # no per-session transposed/prepacked LM head: one copy, slower GEMMs
            opts.add_session_config_entry("session.disable_prepacking", "1")
            kwargs["disabled_optimizers"] = ["ConstantFolding"]
        elif graph in self._tied_head_graphs:
            # Transpose(table) + MatMul: folded, ORT keeps the transposed copy beside the packed
            # one; unfolded it fuses into FusedMatMul(transB=1), packed from the table: one copy
            kwargs["disabled_optimizers"] = ["ConstantFolding"]
        if self._provider == PROVIDERS["tensorrt"] and C.flavour(self.manifest) == "ort":
            raise DFlashError(f"{self.directory} was exported with --attention ort (com.microsoft "
                              "GroupQueryAttention), which TensorRT cannot run; re-export with --attention standard")
        try:
            providers = [self._provider]
            if self._provider == PROVIDERS["tensorrt"]:  # explicit profiles + engine cache outside OUT (runtime/trt_profiles.py)
                from .trt_profiles import ort_trt_provider_options

                m = self.manifest
                self.max_chunk = min(self.max_chunk, m.max_context - m.block_size)  # the profile's longest prefill
                opts_trt = ort_trt_provider_options(m, graph, max_prompt=self.max_chunk)
                providers = [(self._provider, opts_trt), PROVIDERS["cuda"]]
            return ort.InferenceSession(str(path), opts, providers=providers, **kwargs)
        except Exception as e:  # ORT raises its own types; one line for the user
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if self.manifest.dtype == "bf16" and self._provider == PROVIDERS["cpu"]:
                raise DFlashError(f"{path}: ONNX Runtime's CPU provider cannot run bf16 graphs (not run here); use "
                                  "--provider cuda or the TensorRT backend, or export with --dtype fp16/fp32") from None
            raise DFlashError(f"{path}: onnxruntime cannot load it ({first}); re-export the directory") from None

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
        which at 4 bindings per layer was several percent of a small model's step.
        """
        output, dtype, dims = self._specs[graph, name]
        shape = [d if isinstance(d, int) else dynamic.get(d, 1) if d == C.BATCH else dynamic[d] for d in dims]
        base, row, device = self._geometry(buf, dtype)
        ptr = base + offset_rows * row
        raw = self._io[graph]._iobinding
        (raw.bind_output if output else raw.bind_input)(name, device, ONNX_TYPE[dtype], shape, ptr)
        if self.trace is not None:
            self.trace.append((name, ptr, tuple(shape)))

    def _target_io(self, row: int | None):
        """The ort flavour's target binding for all rows (None) or row b: its cache buffers
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
        rows, at = (self.max_batch, 0) if row is None else (1, row * self.manifest.target_kv_heads)
        for i in range(self.manifest.target_layers):
            k, v = self.kv[2 * i], self.kv[2 * i + 1]
            for name, buf in ((C.past_key(i), k), (C.past_value(i), v), (C.PRESENT_KV[0].at(i).name, k),
                              (C.PRESENT_KV[1].at(i).name, v)):
                self._bind(C.TARGET, name, buf, at, batch=rows)
        self._io[C.TARGET] = saved
        return io

    @property
    def provider(self) -> str:
        return f"onnxruntime:{self._provider}"

    # -- the interface -------------------------------------------------------------------

    def target(self, ids: np.ndarray, want_logits: bool = False) -> TargetOut:
        res = self.target_rows([0], np.asarray(ids, np.int64)[None], [len(ids)], None, want_logits)
        return TargetOut(res.next_ids[0], None if res.logits is None else res.logits[0])

    def draft_context(self, n: int) -> None:
        self.draft_context_rows([0], [n])

    def draft_block(self, anchor: int) -> np.ndarray:
        ids, conf = self.draft_block_rows([0], [anchor])
        self.draft_conf = None if conf is None else conf[0]
        return ids[0]

    def target_rows(self, rows, ids, counts, picks=None, want_logits=False) -> TargetOut:
        m, g, lengths, B = self.manifest, C.TARGET, self.lengths, self.max_batch
        R, S = ids.shape
        if not 1 <= S <= self.max_chunk:
            raise DFlashError(f"internal: target call with {S} tokens (1..{self.max_chunk})")
        for b, c in zip(rows, counts):
            if lengths[b] + c > self.max_len:
                raise DFlashError(f"sequence of {lengths[b] + c} positions exceeds the exported max context {self.max_len}")
        if self.in_place and R > 1 and S > 1:  # GroupQueryAttention: several new tokens with a past, one row a call
            return self._target_each(rows, ids, counts, picks, want_logits)
        return self._target_call(rows, ids, counts, picks, want_logits, 0)

    def _target_each(self, rows, ids, counts, picks, want_logits) -> TargetOut:
        R, S = ids.shape
        N = S if picks is None else picks.shape[1]
        next_ids, logits = np.zeros((R, N), np.int64), np.zeros((R, N, self.manifest.vocab_size), np.float32)
        for r, b in enumerate(rows):
            c = int(counts[r])
            if c == 0:  # an idle row
                continue
            at = np.minimum(np.arange(N) if picks is None else picks[r], c - 1)[None]
            res = self._target_call([b], ids[r : r + 1, :c], [c], at, want_logits, r * S)
            next_ids[r] = res.next_ids[0]
            if want_logits:
                logits[r] = res.logits[0]
        self._last_seq = S
        return TargetOut(next_ids, logits if want_logits else None)

    def _target_call(self, rows, ids, counts, picks, want_logits, taps_at: int) -> TargetOut:
        """One session run over `rows` (one row, or all); taps written `taps_at` positions in."""
        m, g, lengths, B = self.manifest, C.TARGET, self.lengths, self.max_batch
        R, S = ids.shape
        one = R == 1
        b0 = rows[0]
        P = int(lengths[b0]) if one else int(lengths.max())
        N = S if picks is None or not self.ragged else picks.shape[1]
        io = self._target_io(b0 if one else None) if self.in_place else self._io[g]
        self._io[g], saved = io, self._io[g]
        self.ids.ravel()[: R * S] = np.asarray(ids).ravel()  # a call's [R, S] from the buffer's start
        self._bind(g, C.INPUT_IDS, self.ids, batch=R, seq=S)
        if one:
            self._bind(g, C.POSITION_IDS, self.positions, P, seq=S)
        else:
            pos = self.row_pos.ravel()[: R * S].reshape(R, S)
            np.add(lengths[rows, None], np.arange(S), out=pos)
            self._bind(g, C.POSITION_IDS, self.row_pos, batch=R, seq=S)
        if self.ragged:
            pick = self.picks.ravel()[: R * N].reshape(R, N)
            pick[:] = np.arange(S) if picks is None else picks
            self._bind(g, C.LOGITS_INDEX, self.picks, batch=R, picks=N)
        if self.in_place:  # GroupQueryAttention writes rows [P_b, P_b + S) of the buffers it reads
            seqlens, total = self.lengths_in
            seqlens[:R] = lengths[rows] + S - 1
            total[()] = P + S
            self._bind(g, C.SEQLENS_K, seqlens, batch=R)
            self._bind(g, C.TOTAL_LEN, total)
        else:
            if self.ragged:
                self.past_lengths[:R] = lengths[rows]
                self._bind(g, C.PAST_LENGTHS, self.past_lengths, batch=R)
            self._bind_target_caches(rows, P, S)
        self._bind(g, C.TAPS, self.taps, taps_at, batch=R, seq=S)
        self._bind(g, C.NEXT_IDS, self.next_ids, batch=R, picks=N, seq=N)
        big = R * N > B * m.block_size
        if big:  # a prefill chunk's every position: ORT allocates its logits
            io.bind_output(C.LOGITS, "cpu" if want_logits else self.device)
        else:
            self._bind(g, C.LOGITS, self.logits if want_logits else self._logits_scratch, batch=R, picks=N, seq=N)
        self.sessions[g].run_with_iobinding(io)
        self._io[g] = saved
        if self.kv_all is not None and not self.in_place:
            _scatter(self.kv_all, self.kv_new, rows, lengths, S, counts)
        self.pending[rows] = counts
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
        (`_scatter`). One row of several: its prefix gathered (prefill chunks, reuse)."""
        m, g, R, B = self.manifest, C.TARGET, len(rows), self.max_batch
        if self.states is not None:
            self.states.layout(R, S)
        at = rows[0] if R == 1 else 0
        gathered = R == 1 and B > 1 and P > 0
        if gathered:
            _gather_row(self.kv_all, self._row_kv, at, P)
        for i in range(m.target_layers):
            if m.is_linear(i):  # committed states in, per-position outputs to commit out
                buf = self.states.buf
                for name in (C.conv_state(i), C.rec_state(i)):
                    self._bind(g, name, buf[name], at * buf[name].shape[1], batch=R)
                for name in (C.new_conv(i), *C.delta(i)):
                    self._bind(g, name, self.states.flat[name], batch=R, seq=S)
                continue
            if B == 1:
                k, v = self.kv[2 * i], self.kv[2 * i + 1]
                self._bind(g, C.past_key(i), k, past=P)
                self._bind(g, C.past_value(i), v, past=P)
                self._bind(g, C.new_key(i), k, P, seq=S)
                self._bind(g, C.new_value(i), v, P, seq=S)
                continue
            for e, (past, new) in enumerate(((C.past_key(i), C.new_key(i)), (C.past_value(i), C.new_value(i)))):
                j = self._kv_slot[2 * i + e]
                self._bind(g, past, self._views["_row_kv" if gathered else "kv_all"][j], batch=R, past=P)
                self._bind(g, new, self._views["kv_new"][j], batch=R, seq=S)

    def draft_context_rows(self, rows, n) -> None:
        m, g, R, B = self.manifest, C.DRAFT_CONTEXT, len(rows), self.max_batch
        lengths = self.ctx_lengths
        c = int(n[0]) if R == 1 else self._last_seq  # several rows: each computes the whole last call
        if c == 0:
            return
        for b, k in zip(rows, n):
            if not 0 <= k <= self._last_seq or lengths[b] + k > self.max_len:
                raise DFlashError(f"internal: draft_context({k}) of row {b} at {lengths[b]} (max {self.max_len})")
        P = int(lengths[rows[0]])
        self._bind(g, C.TAPS, self.taps, batch=R, ctx=c)
        if R == 1:
            self._bind(g, C.CTX_POSITION_IDS, self.positions, P, ctx=c)
        else:
            pos = self.row_pos.ravel()[: R * c].reshape(R, c)
            np.add(lengths[rows, None], np.arange(c), out=pos)
            self._bind(g, C.CTX_POSITION_IDS, self.row_pos, batch=R, ctx=c)
        for j in range(2 * m.draft_layers):
            name = C.ctx_key(j // 2) if j % 2 == 0 else C.ctx_value(j // 2)
            if B == 1:
                self._bind(g, name, self.ctx[j], P, ctx=c)
            else:
                self._bind(g, name, self._views["ctx_new"][j], batch=R, ctx=c)
        self.sessions[g].run_with_iobinding(self._io[g])
        if B > 1:
            _scatter(self.ctx_all, self.ctx_new, rows, lengths, c, n)
        lengths[rows] += n

    def draft_block_rows(self, rows, anchors):
        m, g, R, B, K = self.manifest, C.DRAFT_BLOCK, len(rows), self.max_batch, self.manifest.block_size
        lengths = self.ctx_lengths
        P = int(lengths[rows[0]]) if R == 1 else int(lengths.max())
        self.block_ids[:R, 0] = anchors
        self._bind(g, C.BLOCK_IDS, self.block_ids, batch=R)
        if R == 1:
            self._bind(g, C.BLOCK_POSITION_IDS, self.positions, P)
        else:
            pos = self.row_pos.ravel()[: R * K].reshape(R, K)
            np.add(lengths[rows, None], np.arange(K), out=pos)
            self._bind(g, C.BLOCK_POSITION_IDS, self.row_pos, batch=R)
        if self.ragged:
            self.ctx_lengths_in[:R] = lengths[rows]
            self._bind(g, C.CTX_LENGTHS, self.ctx_lengths_in, batch=R)
        gathered = R == 1 and B > 1 and P > 0
        if gathered:
            _gather_row(self.ctx_all, self._row_ctx, rows[0], P)
        for j in range(2 * m.draft_layers):
            name = C.past_ctx_key(j // 2) if j % 2 == 0 else C.past_ctx_value(j // 2)
            self._bind(g, name, self._views["_row_ctx"][j] if gathered else self.ctx[j], batch=R, past_ctx=P)
        self._bind(g, C.DRAFT_IDS, self.draft_ids, batch=R)
        self._bind(g, C.DRAFT_LOGITS, self._draft_logits, batch=R)
        self._bind(g, C.DRAFT_CONF, self._conf, batch=R)
        self.sessions[g].run_with_iobinding(self._io[g])
        self.draft_conf = self._conf[0]  # the first row's, as `draft_block` returns it
        return self.draft_ids[:R], self._conf[:R]

    def close(self) -> None:
        self.sessions = {}  # forks keep theirs: a session is freed with its last user
        self._io = {}
