"""The TensorRT backend: three engines on one CUDA stream over device KV buffers.

`TensorRTBackend` implements the Backend interface (runtime/backend.py) with the name-based
execution API that TensorRT 10 introduced and 11 keeps (set_input_shape, set_tensor_address,
execute_async_v3) and cuda-python's runtime bindings for memory and the stream. Shapes and
limits come from runtime/trt/profiles.py; this file only moves bytes and runs engines.

NOT YET EXECUTED ON TENSORRT HARDWARE: it needs `tensorrt`, `cuda-python` and an NVIDIA GPU.
The test suite runs it against a double of the real TensorRT 10.12 and 11.4 Python bindings
(tests/trt_double.py: every attribute, call, argument and return value checked against
NVIDIA's own signatures; what an engine computes is simulated with ONNX Runtime) and a
hand-written cuda-python stand-in; on a GPU machine tests/test_trt_gpu.py runs it for real.

`tensorrt` and `cuda` are imported inside functions only: importing this module needs numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backend import Backend, Draft, TargetOut
from .. import contract as C
from ..names import names_of
from ..contract import DRAFT_BLOCK, DRAFT_CONTEXT, TARGET, draft_vocab_size
from ..manifest import Manifest, load_manifest
from ...errors import DFlashError, InternalError
from ..hybrid import LinearStates
from .profiles import ENGINE_FILES, check_engine_record, check_trt_version
from .rows import TrtRows, check_engine_rows

INSTALL_HINT = 'pip install "dflash-export[trt]" (or: pip install tensorrt cuda-python --extra-index-url https://pypi.nvidia.com)'
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}


def import_tensorrt():
    """`tensorrt` and cuda-python's runtime module, or one DFlashError naming what is missing."""
    missing = []
    try:
        import tensorrt as trt
    except ImportError:
        trt = None
        missing.append("tensorrt")
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6 (the `trt` extra's floor)
    except ImportError:
        cudart = None
        missing.append("cuda-python")
    if missing:
        raise DFlashError(f"TensorRT support needs the Python package(s) {', '.join(missing)}; install with: {INSTALL_HINT}")
    check_trt_version(trt.__version__)
    return trt, cudart


def cuda_check(result):
    """cuda-python calls return (err, *values): raise on error, return the values."""
    err, *vals = result if isinstance(result, tuple) else (result,)
    if int(getattr(err, "value", err)) != 0:  # cudaError_t.cudaSuccess == 0
        raise DFlashError(f"CUDA error {err!r}; check the driver and that the GPU is visible (nvidia-smi)")
    return vals[0] if len(vals) == 1 else (tuple(vals) if vals else None)


def gpu_info(cudart, device: int = 0) -> tuple[str, str]:
    """(compute capability "major.minor", GPU name) of `device`."""
    prop = cuda_check(cudart.cudaGetDeviceProperties(device))
    name = prop.name.decode(errors="replace").rstrip("\x00") if isinstance(prop.name, bytes) else str(prop.name)
    return f"{prop.major}.{prop.minor}", name


# -- the backend (NOT EXECUTED in development: no TensorRT, no GPU there) ----------------------

ALIGN = 256  # bytes: device addresses handed to TensorRT are kept 256-byte aligned


@dataclass
class _Engine:
    engine: object
    contexts: list  # one execution context per optimization profile


class TensorRTBackend(TrtRows, Backend):
    """Runs the three engines on one CUDA stream over device KV buffers it owns.

    KV buffers are sequence-major [1, max_len, Hkv, D] (as on ONNX Runtime): a call binds
    the valid prefix in place with set_tensor_address (no copy) and the graph's new K/V
    outputs are bound straight into the slots after it when that address is 256-byte
    aligned; otherwise they land in a scratch buffer and only those S rows are copied.
    `max_batch` > 1 (engines built with `--max-batch`): position-major caches, runtime/trt/rows.py.

    Hybrid targets (docs/hybrid.md): a linear-attention layer's committed states and a call's
    per-position increments are runtime/hybrid.py's host buffers, the same code and commit as
    on ONNX Runtime; this backend only copies the increments (S rows) to the host after each
    call and the committed states back to the device before the next call that follows a commit.

    No CUDA graphs: a graph bakes in shapes and addresses, and the past length changes on
    every call, so within one generation no captured graph would ever be replayed.
    """

    def __init__(self, out_dir: str | Path, manifest: Manifest | None = None, *, drafter: bool = True,
                 device: int = 0, max_batch: int = 1):
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
        self._allocs: list[int] = []

        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.has_drafter = drafter
        graphs = (TARGET, DRAFT_CONTEXT, DRAFT_BLOCK) if drafter else (TARGET,)
        self.eng = {g: self._load(g, len(rec["profiles"][g])) for g in graphs}
        self.inputs = {g: C.io(g, m)[0] for g in graphs}  # the contract's inputs, in order

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
        self.ragged = C.ragged(m)  # contract.RAGGED: per-row lengths and logits picks
        self._alloc_rows(ms)
        self._taps_n = 0
        self.gpu = gpu
        self._check_io()

    def _check_io(self) -> None:
        """Every tensor this backend binds exists in the engine as an input or output (as bound) with the
        element size allocated for it, and every input's profile shapes are the manifest's record."""
        trt, m = self.trt, self.manifest
        size = {trt.float32: 4, trt.float16: 2, trt.bfloat16: 2, trt.int64: 8, trt.int32: 4}
        for graph, e in self.eng.items():
            names = {e.engine.get_tensor_name(i) for i in range(e.engine.num_io_tensors)}
            ins, outs = C.io(graph, m)
            bound = [(t, trt.TensorIOMode.INPUT) for t in self.inputs[graph]] + [(t, trt.TensorIOMode.OUTPUT) for t in outs]
            for t, mode in bound:
                where = f"{ENGINE_FILES[graph]}: {t.name}"
                if t.name not in names:
                    raise DFlashError(f"{ENGINE_FILES[graph]} has no tensor {t.name}; rebuild the engines for this export")
                if e.engine.get_tensor_mode(t.name) != mode:
                    raise DFlashError(f"{where} is not an {mode.name.lower()} of the engine; "
                                      "rebuild the engines for this export")
                got, want = size.get(e.engine.get_tensor_dtype(t.name)), C.dtype(t, m)
                if got != ITEMSIZE[want]:
                    raise DFlashError(f"{where} is {e.engine.get_tensor_dtype(t.name)} in the "
                                      f"engine but {want} in the graph contract; rebuild the engines for this export")
            for i, prof in enumerate(self.record["profiles"][graph]):
                for t in ins:
                    got = [list(d) for d in e.engine.get_tensor_profile_shape(t.name, i)]
                    if got != prof["shapes"][t.name]:
                        raise DFlashError(f"{ENGINE_FILES[graph]}: profile {i} of {t.name} is {got} in the engine but "
                                          f"{prof['shapes'][t.name]} in the manifest; rebuild with `dflash-export build`")

    # -- setup ----------------------------------------------------------------------------

    cuda_check = staticmethod(cuda_check)  # for runtime/trt/rows.py

    def _load(self, graph: str, nprof: int) -> _Engine:
        path = self.out / ENGINE_FILES[graph]
        engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise DFlashError(f"{path}: TensorRT could not deserialize this engine; rebuild with `dflash-export build`")
        if engine.num_optimization_profiles != nprof:
            raise DFlashError(f"{path} has {engine.num_optimization_profiles} optimization profiles but the manifest "
                              f"records {nprof}; rebuild with `dflash-export build`")
        contexts = []
        for i in range(nprof):
            ctx = engine.create_execution_context()
            if i and not ctx.set_optimization_profile_async(i, self.handle):
                raise DFlashError(f"{path}: TensorRT refused optimization profile {i}; rebuild with `dflash-export build`")
            contexts.append(ctx)
        cuda_check(self.cudart.cudaStreamSynchronize(self.stream))
        return _Engine(engine, contexts)

    def _malloc(self, nbytes: int) -> int:
        ptr = int(cuda_check(self.cudart.cudaMalloc(max(int(nbytes), ALIGN))))
        self._allocs.append(ptr)
        return ptr

    # -- copies ---------------------------------------------------------------------------

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

    # -- running one engine ---------------------------------------------------------------

    def _bind(self, ctx, shapes: dict[str, tuple], addrs: dict[str, int]) -> None:
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise InternalError(f"TensorRT refused shape {shape} for {name}; rebuild the engines")
        for name, ptr in addrs.items():
            if not ctx.set_tensor_address(name, ptr):
                raise InternalError(f"TensorRT refused the address of {name}")

    def _run(self, graph: str, prof: int, addrs: dict, **dynamic: int) -> None:
        """Enqueue one engine call on the stream (execute_async_v3); input shapes from the contract."""
        ctx = self.eng[graph].contexts[prof]
        shapes = {t.name: C.shape(t, self.manifest, **({"batch": 1} | dynamic)) for t in self.inputs[graph]}
        self._bind(ctx, shapes, addrs)
        if not ctx.execute_async_v3(self.handle):
            raise InternalError("TensorRT execute_async_v3 failed (see the TensorRT log above)")

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
        self._run(TARGET, prof, addrs, seq=s, past=p, picks=s)
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
        self._run(DRAFT_CONTEXT, 0, addrs, ctx=c)
        for dst, src, nb in copies:
            self._d2d(dst, src, nb)
        self._sync()
        self.context_len += c

    def draft_block(self, anchor: int) -> Draft:
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
        self._run(DRAFT_BLOCK, 0, addrs, past_ctx=p)
        self._d2h(self.h_draft[: k - 1], self.d_draft)
        if self.d_conf is not None:
            self._d2h(self.h_conf[: k - 1], self.d_conf)
        self._sync()
        return Draft(self.h_draft[: k - 1], self.h_conf[: k - 1] if self.d_conf is not None else None)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        cudart = getattr(self, "cudart", None)
        if cudart is None:
            return
        for e in getattr(self, "eng", {}).values():
            e.contexts.clear()
        self.eng = {}
        for ptr in self._allocs:
            cudart.cudaFree(ptr)
        self._allocs = []
        if getattr(self, "stream", None) is not None:
            cudart.cudaStreamDestroy(self.stream)
            self.stream = None

    @property
    def provider(self) -> str:
        return f"tensorrt {self.trt.__version__} ({self.record.get('precision')}, {self.gpu})"
