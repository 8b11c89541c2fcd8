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
from .backend import Backend, Draft, TargetOut
from .errors import DFlashError, InternalError
from .hybrid import LinearStates
from .shared import ONNX_TYPE, STORAGE, shared_weights, tied_head_graphs

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def load_hint(first: str) -> str:
    """What to do about an ONNX Runtime load failure, from its first line; nothing when the cause is unclear."""
    if any(k in first for k in ("INVALID_PROTOBUF", "NO_SUCHFILE", "external data", "INVALID_GRAPH")):
        return " (the file is damaged or incomplete: re-export the directory)"
    if any(k in first for k in ("NOT_IMPLEMENTED", "Could not find an implementation", "opset")):
        return " (this onnxruntime cannot run an op of the graph: install the version `dflash-export info` lists)"
    return ""


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
    ):
        self.directory = Path(directory)
        self._provider = resolve_provider(provider)
        self.manifest = m = M.load_manifest(self.directory, verify=verify)
        self.names = C.names_of(m)
        self.max_len = m.max_context
        self.max_chunk = max(max_chunk, m.block_size)
        self.device = "cpu" if self._provider == PROVIDERS["cpu"] else "cuda"
        if C.max_seq(m):  # hybrid target: one delta-rule chunk per call, states committed on the host
            # (runtime/hybrid.py: numpy buffers, bound as host memory on every provider; a GPU provider
            # copies them in and the increments out each call. Not executed here: no GPU.)
            self.max_chunk = min(self.max_chunk, C.max_seq(m))
        self.has_drafter = drafter
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
        """The per-sequence state: KV buffers, taps, ids and one IO binding per session.

        Everything else (sessions, shared weights, manifest) is read-only after load, so
        `fork` can hand it to another sequence.
        """
        m = self.manifest
        self._geom = {}
        self._io = {k: s.io_binding() for k, s in self.sessions.items()}
        self._static_bound = False  # ort flavour: cache buffers bound (on the first call)

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
        L, Hkv, D = m.target_layers, m.target_kv_heads, m.target_head_dim
        self.in_place = C.flavour(m) == "ort"  # head-major cache, past and present one buffer (contract.TARGET_ORT)
        kv_shape = (1, Hkv, self.max_len, D) if self.in_place else (1, self.max_len, Hkv, D)
        self.kv = [None if m.is_linear(i) else self._alloc(kv_shape, kv_type)
                   for i in range(L) for _ in (0, 1)]  # k0 v0 k1 v1 ... (none for linear-attention layers)
        self.states = LinearStates(m, self.max_chunk) if m.linear_layers else None
        self.lengths = np.zeros(1, np.int32), np.zeros((), np.int32)  # ort flavour: seqlens_k, total_sequence_length
        self.taps = self._alloc((1, self.max_chunk, static[C.TAPS_WIDTH]), C.dtype(C.tensor(C.TARGET, C.TAPS, m), m))
        K, V = m.block_size, m.vocab_size
        self.logits = np.empty((1, K, V), np.float32)  # host: verify logits when sampling
        self.next_ids = np.empty((1, self.max_chunk), np.int64)
        self.ids = np.empty((1, self.max_chunk), np.int64)
        self.positions = np.arange(self.max_len + K, dtype=np.int64)[None]
        if self.device == "cpu":
            self._logits_scratch = self.logits  # logits not asked for still land somewhere preallocated
        else:
            self._logits_scratch = self._alloc((1, K, V), "float32")
        if self.has_drafter:
            dL, dH, dD = m.draft_layers, m.draft_kv_heads, m.draft_head_dim
            self.ctx = [self._alloc((1, self.max_len, dH, dD), C.dtype(C.CTX_KV[0], m)) for _ in range(2 * dL)]
            self.block_ids = np.full((1, K), m.mask_token_id, np.int64)
            self.draft_ids = np.empty((1, K - 1), np.int64)
            self._draft_logits = self._alloc((1, K - 1, C.draft_vocab_size(m)), "float32")
            self._conf = np.empty((1, K - 1), np.float32)

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
            raise DFlashError(f"{path}: onnxruntime {ort.__version__} with {self._provider} cannot load the {graph} "
                              f"graph: {first}{load_hint(first)}") from None

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
        shape = [d if isinstance(d, int) else 1 if d == C.BATCH else dynamic[d] for d in dims]
        base, row, device = self._geometry(buf, dtype)
        ptr = base + offset_rows * row
        raw = self._io[graph]._iobinding
        (raw.bind_output if output else raw.bind_input)(name, device, ONNX_TYPE[dtype], shape, ptr)
        if self.trace is not None:
            self.trace.append((name, ptr, tuple(shape)))

    def _bind_static(self) -> None:
        """The ort flavour's target: bind the whole cache buffers (past and present) once; they
        never move and the binding keeps them across runs (rebinding 4 per layer cost ~0.1 ms
        a call at 6 layers). Not the lengths: binding copies a host input the kernel wants on
        the GPU at bind time, so they are bound after their values are written, every call."""
        g, N = C.TARGET, self.names
        for i in range(self.manifest.target_layers):
            k, v = self.kv[2 * i], self.kv[2 * i + 1]
            for name, buf in ((N.past_key[i], k), (N.past_value[i], v), (N.present_key[i], k), (N.present_value[i], v)):
                self._bind(g, name, buf)
        self._static_bound = True

    @property
    def provider(self) -> str:
        return f"onnxruntime:{self._provider}"

    # -- the interface -------------------------------------------------------------------

    def _target(self, ids: np.ndarray, want_logits: bool) -> TargetOut:
        m, P, S, g, N = self.manifest, self.target_len, len(ids), C.TARGET, self.names
        if not 1 <= S <= self.max_chunk:
            raise InternalError(f"target call with {S} tokens (1..{self.max_chunk})")
        if P + S > self.max_len:
            raise DFlashError(f"sequence of {P + S} positions exceeds the exported max context {self.max_len}")
        self.ids[0, :S] = ids
        self._bind(g, C.INPUT_IDS, self.ids, seq=S)
        self._bind(g, C.POSITION_IDS, self.positions, P, seq=S)
        if self.in_place:  # GroupQueryAttention writes rows [P, P + S) of the buffers it reads
            seqlens, total = self.lengths
            seqlens[0], total[()] = P + S - 1, P + S
            self._bind(g, C.SEQLENS_K, seqlens)
            self._bind(g, C.TOTAL_LEN, total)
            if not self._static_bound:
                self._bind_static()
        for i in () if self.in_place else range(m.target_layers):  # ort flavour: bound once, above
            if m.is_linear(i):  # committed states in, per-position outputs to commit out
                buf = self.states.buf
                for name in (N.conv_state[i], N.rec_state[i]):
                    self._bind(g, name, buf[name])
                for name in (N.new_conv[i], *N.delta[i]):
                    self._bind(g, name, buf[name], seq=S)
                continue
            k, v = self.kv[2 * i], self.kv[2 * i + 1]
            self._bind(g, N.past_key[i], k, past=P)
            self._bind(g, N.past_value[i], v, past=P)
            self._bind(g, N.new_key[i], k, P, seq=S)
            self._bind(g, N.new_value[i], v, P, seq=S)
        self._bind(g, C.TAPS, self.taps, seq=S)
        self._bind(g, C.NEXT_IDS, self.next_ids, seq=S)
        io = self._io[g]
        big = S > m.block_size
        if big:  # prefill chunk: ORT allocates its logits (we only need the last row, if any)
            io.bind_output(C.LOGITS, "cpu" if want_logits else self.device)
        else:
            self._bind(g, C.LOGITS, self.logits if want_logits else self._logits_scratch, seq=S)
        self.sessions[g].run_with_iobinding(io)
        logits = None
        if want_logits:
            logits = io.get_outputs()[-1].numpy()[0] if big else self.logits[0, :S]
        return TargetOut(self.next_ids[0, :S], logits)

    def draft_context(self, n: int) -> None:
        m, P, g, N = self.manifest, self.context_len, C.DRAFT_CONTEXT, self.names
        if not 0 < n <= self.max_chunk or P + n > self.max_len:
            raise InternalError(f"draft_context({n}) at {P} (max {self.max_len})")
        self._bind(g, C.TAPS, self.taps, ctx=n)
        self._bind(g, C.CTX_POSITION_IDS, self.positions, P, ctx=n)
        for j in range(m.draft_layers):
            self._bind(g, N.ctx_key[j], self.ctx[2 * j], P, ctx=n)
            self._bind(g, N.ctx_value[j], self.ctx[2 * j + 1], P, ctx=n)
        self.sessions[g].run_with_iobinding(self._io[g])
        self.context_len += n

    def draft_block(self, anchor: int) -> Draft:
        m, P, g, N = self.manifest, self.context_len, C.DRAFT_BLOCK, self.names
        self.block_ids[0, 0] = anchor
        self._bind(g, C.BLOCK_IDS, self.block_ids)
        self._bind(g, C.BLOCK_POSITION_IDS, self.positions, P)
        for j in range(m.draft_layers):
            self._bind(g, N.past_ctx_key[j], self.ctx[2 * j], past_ctx=P)
            self._bind(g, N.past_ctx_value[j], self.ctx[2 * j + 1], past_ctx=P)
        self._bind(g, C.DRAFT_IDS, self.draft_ids)
        self._bind(g, C.DRAFT_LOGITS, self._draft_logits)
        self._bind(g, C.DRAFT_CONF, self._conf)
        self.sessions[g].run_with_iobinding(self._io[g])
        return Draft(self.draft_ids[0], self._conf[0])

    def close(self) -> None:
        self.sessions = {}  # forks keep theirs: a session is freed with its last user
        self._io = {}
