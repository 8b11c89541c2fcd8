"""ONNX Runtime backend: three sessions over one exported directory, KV caches bound in place.

Every tensor a call touches lives in a buffer allocated once at load: the target's and
the drafter's KV caches ([1, max_len, Hkv, D] per layer), the taps of the last target
call, the output ids and logits. A call binds raw pointers into them through IO binding:
the valid prefix of a cache as the `past_*` input, the slots right after it as the
`new_*` / `ctx_*` output. ORT writes the new K/V straight into the cache; nothing is
copied and nothing grows with the context but attention itself.

The shared initializers (embedding, LM head) are read once from target.onnx (inline or
external data) and handed to both target and draft_block sessions with `add_initializer`:
one copy in memory, used in place by both. The embedding is read in place; the LM head
feeds Transpose + MatMul, which ORT constant-folds and prepacks per session (one packed
copy each, the fast path); `low_memory=True` turns both off so the one copy is all there
is, at the price of slower GEMMs (README, Runtime).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import contract as C
from .backend import Backend, TargetOut
from .errors import DFlashError

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
ONNX_TYPE = {"float32": 1, "float16": 10, "bfloat16": 16, "int64": 7}  # TensorProto.DataType
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int64": np.int64}
FROM_ONNX = {v: k for k, v in ONNX_TYPE.items()}


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


# -- reading initializers without the onnx package (protobuf wire format) ----------------


def _varint(b: memoryview, i: int) -> tuple[int, int]:
    shift = out = 0
    while True:
        x = b[i]
        i += 1
        out |= (x & 0x7F) << shift
        if x < 0x80:
            return out, i
        shift += 7


def _fields(b: memoryview, start: int = 0, end: int | None = None):
    """(field number, wire type, value) of one protobuf message; LEN values as (offset, length)."""
    i, end = start, len(b) if end is None else end
    while i < end:
        key, i = _varint(b, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            v, i = (i, n), i + n
        elif wire == 1:
            v, i = None, i + 8
        elif wire == 5:
            v, i = None, i + 4
        else:
            raise DFlashError(f"unsupported protobuf wire type {wire}; the graph file is corrupt")
        yield field, wire, v


def read_initializers(
    model: Path, names: tuple[str, ...], required: bool = True, load: bool = True
) -> dict[str, tuple[np.ndarray, int] | None]:
    """name -> (array with the raw bytes, onnx element type) for the named initializers
    that the graph has (None for each instead when not `load`)."""
    out: dict[str, tuple[np.ndarray, int] | None] = {}
    seen: dict = {}  # storage location -> loaded array, so tied weights are read once
    with open(model, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        b = memoryview(mm)
        try:
            graph = next(v for fld, w, v in _fields(b) if fld == 7 and w == 2)  # ModelProto.graph
            for fld, w, v in _fields(b, graph[0], graph[0] + graph[1]):
                if fld != 5 or w != 2:  # GraphProto.initializer
                    continue
                t = _tensor(b, *v)
                if t["name"] in names:
                    where = tuple(sorted(t["external"].items())) or t["raw"]  # tied weights: same bytes
                    if load and where not in seen:
                        seen[where] = _tensor_data(model, b, t)
                    out[t["name"]] = seen.get(where) if load else None
        finally:
            b.release()
    missing = [n for n in names if n not in out]
    if missing and required:
        raise DFlashError(f"{model}: shared initializers {missing} not found; re-export the directory")
    return out


def _tensor(b: memoryview, off: int, n: int) -> dict:
    t = {"dims": [], "type": 0, "name": "", "raw": None, "external": {}}
    for fld, w, v in _fields(b, off, off + n):
        if fld == 1 and w == 0:
            t["dims"].append(v)
        elif fld == 1 and w == 2:  # packed dims
            i, e = v[0], v[0] + v[1]
            while i < e:
                d, i = _varint(b, i)
                t["dims"].append(d)
        elif fld == 2:
            t["type"] = v
        elif fld == 8:
            t["name"] = bytes(b[v[0] : v[0] + v[1]]).decode()
        elif fld == 9:
            t["raw"] = v
        elif fld == 13:  # external_data: StringStringEntryProto {key=1, value=2}
            kv = {f: bytes(b[x[0] : x[0] + x[1]]).decode() for f, _, x in _fields(b, v[0], v[0] + v[1])}
            t["external"][kv.get(1)] = kv.get(2)
    return t


def _tensor_data(model: Path, b: memoryview, t: dict) -> tuple[np.ndarray, int]:
    if t["type"] not in FROM_ONNX:
        raise DFlashError(f"{model}: initializer {t['name']} has unsupported element type {t['type']}")
    dtype = np.dtype(STORAGE[FROM_ONNX[t["type"]]])
    count = int(np.prod(t["dims"])) if t["dims"] else 1
    if t["raw"] is not None:
        off, n = t["raw"]
        data = np.frombuffer(bytes(b[off : off + n]), dtype=dtype)
    elif "location" in t["external"]:
        ext = t["external"]
        path = (model.parent / ext["location"]).resolve()
        if model.parent.resolve() not in path.parents:
            raise DFlashError(f"{model}: external data {ext['location']} points outside the directory")
        data = np.fromfile(path, dtype=dtype, count=count, offset=int(ext.get("offset", 0)))
    else:
        raise DFlashError(f"{model}: initializer {t['name']} has no raw or external data; re-export the directory")
    if data.size != count:
        raise DFlashError(f"{model}: initializer {t['name']} holds {data.size} values, expected {count}")
    return data.reshape(t["dims"]), t["type"]


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
        drafter: bool = True,
        verify: bool = True,
        low_memory: bool = False,
    ):
        self.directory = Path(directory)
        self._provider = resolve_provider(provider)
        self.manifest = m = C.load_manifest(self.directory, verify=verify)
        self.max_len = m.max_context
        self.max_chunk = max(max_chunk, m.block_size)
        self.device = "cpu" if self._provider == PROVIDERS["cpu"] else "cuda"
        self.has_drafter = drafter
        self.low_memory = low_memory
        self.trace: list | None = None  # set to [] to record every bound (name, ptr, shape)
        self._geom: dict[int, tuple] = {}  # id(buffer) -> (pointer, row bytes, device), see _bind

        # one copy of the shared weights, used in place by both sessions
        # (an initializer the graph lacks is simply not shared: it costs memory, not correctness)
        self._shared = read_initializers(self.directory / m.graphs[C.TARGET].file, C.SHARED_INITIALIZERS, False)
        self._shared_ov = {
            n: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, t) for n, (a, t) in self._shared.items()
        }
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.sessions = {C.TARGET: self._session(C.TARGET, opts)}
        if drafter:
            self.sessions[C.DRAFT_CONTEXT] = self._session(C.DRAFT_CONTEXT, opts)
            self.sessions[C.DRAFT_BLOCK] = self._session(C.DRAFT_BLOCK, opts)
        self._io = {k: s.io_binding() for k, s in self.sessions.items()}

        tin = {t.name: t for t in m.graphs[C.TARGET].inputs}
        tout = {t.name: t for t in m.graphs[C.TARGET].outputs}
        self._kv_type = tin[C.past_key(0)].dtype
        self._taps_type = tout["taps"].dtype
        L, Hkv, D = m.target_layers, m.target_kv_heads, m.target_head_dim
        self.kv = [self._alloc((1, self.max_len, Hkv, D), self._kv_type) for _ in range(2 * L)]  # k0 v0 k1 v1 ...
        taps_width = tout["taps"].shape[-1]
        self.taps = self._alloc((1, self.max_chunk, taps_width), self._taps_type)
        K, V = m.block_size, m.vocab_size
        self.logits = np.empty((1, K, V), np.float32)  # host: verify logits when sampling
        self.next_ids = np.empty((1, self.max_chunk), np.int64)
        self.ids = np.empty((1, self.max_chunk), np.int64)
        self.positions = np.arange(self.max_len + K, dtype=np.int64)[None]
        if self.device == "cpu":
            self._logits_scratch = self.logits  # logits not asked for still land somewhere preallocated
        else:
            self._logits_scratch = self._alloc((1, K, V), "float32")
        if drafter:
            dL, dH, dD = m.draft_layers, m.draft_kv_heads, m.draft_head_dim
            dtype = {t.name: t for t in m.graphs[C.DRAFT_CONTEXT].outputs}[C.ctx_key(0)].dtype
            self._ctx_type = dtype
            self.ctx = [self._alloc((1, self.max_len, dH, dD), dtype) for _ in range(2 * dL)]
            self.block_ids = np.full((1, K), m.mask_token_id, np.int64)
            self.draft_ids = np.empty((1, K - 1), np.int64)
            self._draft_logits = self._alloc((1, K - 1, V), "float32")

    # -- setup ---------------------------------------------------------------------------

    def _session(self, graph: str, base: ort.SessionOptions) -> ort.InferenceSession:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = base.intra_op_num_threads
        path = self.directory / self.manifest.graphs[graph].file
        if graph in (C.TARGET, C.DRAFT_BLOCK):
            has = read_initializers(path, tuple(self._shared_ov), required=False, load=False)
            for name in has:
                opts.add_initializer(name, self._shared_ov[name])
        kwargs = {}
        if self.low_memory:  # no per-session transposed/prepacked LM head: one copy, slower GEMMs
            opts.add_session_config_entry("session.disable_prepacking", "1")
            kwargs["disabled_optimizers"] = ["ConstantFolding"]
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

    def _bind(self, io, output: bool, name: str, buf, dtype: str, shape: list, offset_rows: int = 0):
        """Bind `shape` starting `offset_rows` rows (axis 1) into `buf`, in place.

        Calls the binding's C++ object directly: the Python wrapper costs ~8 us a call,
        which at 4 bindings per layer was several percent of a small model's step.
        """
        base, row, device = self._geometry(buf, dtype)
        ptr = base + offset_rows * row
        raw = io._iobinding
        (raw.bind_output if output else raw.bind_input)(name, device, ONNX_TYPE[dtype], shape, ptr)
        if self.trace is not None:
            self.trace.append((name, ptr, tuple(shape)))

    @property
    def provider(self) -> str:
        return f"onnxruntime:{self._provider}"

    # -- the interface -------------------------------------------------------------------

    def target(self, ids: np.ndarray, want_logits: bool = False) -> TargetOut:
        m, P, S = self.manifest, self.target_len, len(ids)
        if not 1 <= S <= self.max_chunk:
            raise DFlashError(f"internal: target call with {S} tokens (1..{self.max_chunk})")
        if P + S > self.max_len:
            raise DFlashError(f"sequence of {P + S} positions exceeds the exported max context {self.max_len}")
        L, Hkv, D = m.target_layers, m.target_kv_heads, m.target_head_dim
        io = self._io[C.TARGET]
        self.ids[0, :S] = ids
        self._bind(io, False, "input_ids", self.ids, "int64", [1, S])
        self._bind(io, False, "position_ids", self.positions, "int64", [1, S], P)
        for i in range(L):
            k, v = self.kv[2 * i], self.kv[2 * i + 1]
            self._bind(io, False, C.past_key(i), k, self._kv_type, [1, P, Hkv, D])
            self._bind(io, False, C.past_value(i), v, self._kv_type, [1, P, Hkv, D])
            self._bind(io, True, C.new_key(i), k, self._kv_type, [1, S, Hkv, D], P)
            self._bind(io, True, C.new_value(i), v, self._kv_type, [1, S, Hkv, D], P)
        self._bind(io, True, "taps", self.taps, self._taps_type, [1, S, self.taps_width])
        self._bind(io, True, "next_ids", self.next_ids, "int64", [1, S])
        big = S > m.block_size
        if big:  # prefill chunk: ORT allocates its logits (we only need the last row, if any)
            io.bind_output("logits", "cpu" if want_logits else self.device)
        else:
            buf = self.logits if want_logits else self._logits_scratch
            self._bind(io, True, "logits", buf, "float32", [1, S, m.vocab_size])
        self.sessions[C.TARGET].run_with_iobinding(io)
        self._pending = S
        logits = None
        if want_logits:
            logits = io.get_outputs()[-1].numpy()[0] if big else self.logits[0, :S]
        return TargetOut(self.next_ids[0, :S], logits)

    @property
    def taps_width(self) -> int:
        return self.taps.shape[-1] if isinstance(self.taps, np.ndarray) else self.taps.shape()[-1]

    def draft_context(self, n: int) -> None:
        m, P = self.manifest, self.context_len
        if not 0 < n <= self.max_chunk or P + n > self.max_len:
            raise DFlashError(f"internal: draft_context({n}) at {P} (max {self.max_len})")
        io = self._io[C.DRAFT_CONTEXT]
        self._bind(io, False, "taps", self.taps, self._taps_type, [1, n, self.taps_width])
        self._bind(io, False, "ctx_position_ids", self.positions, "int64", [1, n], P)
        dH, dD = m.draft_kv_heads, m.draft_head_dim
        for j in range(m.draft_layers):
            self._bind(io, True, C.ctx_key(j), self.ctx[2 * j], self._ctx_type, [1, n, dH, dD], P)
            self._bind(io, True, C.ctx_value(j), self.ctx[2 * j + 1], self._ctx_type, [1, n, dH, dD], P)
        self.sessions[C.DRAFT_CONTEXT].run_with_iobinding(io)
        self.context_len += n

    def draft_block(self, anchor: int) -> np.ndarray:
        m, P, K = self.manifest, self.context_len, self.manifest.block_size
        io = self._io[C.DRAFT_BLOCK]
        self.block_ids[0, 0] = anchor
        self._bind(io, False, "block_ids", self.block_ids, "int64", [1, K])
        self._bind(io, False, "block_position_ids", self.positions, "int64", [1, K], P)
        dH, dD = m.draft_kv_heads, m.draft_head_dim
        for j in range(m.draft_layers):
            self._bind(io, False, C.past_ctx_key(j), self.ctx[2 * j], self._ctx_type, [1, P, dH, dD])
            self._bind(io, False, C.past_ctx_value(j), self.ctx[2 * j + 1], self._ctx_type, [1, P, dH, dD])
        self._bind(io, True, "draft_ids", self.draft_ids, "int64", [1, K - 1])
        self._bind(io, True, "draft_logits", self._draft_logits, "float32", [1, K - 1, m.vocab_size])
        self.sessions[C.DRAFT_BLOCK].run_with_iobinding(io)
        return self.draft_ids[0]

    def close(self) -> None:
        self.sessions.clear()
        self._io.clear()
