"""TensorRT on the runtime side: optimization profiles, engine checks, the TensorRT backend.

Three parts, top to bottom:

1. Profiles (pure Python, unit-tested without TensorRT): which shapes each graph must
   accept, derived from the manifest. `export/trt.py` builds engines with them, the
   backend below checks calls against them, and `ort_trt_provider_options` hands them to
   ONNX Runtime's TensorRT execution provider.
2. Engine record checks (pure Python): refuse engines built by another TensorRT version
   or for another GPU architecture, with a message that says what to do.
3. `TensorRTBackend`: the Backend interface (runtime/backend.py) over TensorRT 10 engines,
   with device KV buffers, one CUDA stream, execute_async_v3 and CUDA graphs.

NOT EXECUTED IN DEVELOPMENT: part 3 (and the ORT TensorRT-provider run) needs `tensorrt`,
`cuda-python` and an NVIDIA GPU, none of which the development machines have. It was
written against the TensorRT 10 Python API documentation and is exercised only by the
GPU-gated tests (tests/test_trt_gpu.py), which skip here. Parts 1 and 2 are tested.

`tensorrt` and `cuda` are imported inside functions only: importing this module needs numpy.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .backend import Backend, TargetOut
from .contract import DRAFT_BLOCK, DRAFT_CONTEXT, TARGET, GraphSpec, Manifest, load_manifest
from .errors import DFlashError

INSTALL_HINT = 'pip install "dflash-export[trt]" (or: pip install tensorrt cuda-python --extra-index-url https://pypi.nvidia.com)'
ENGINE_DIR = "engines"
ENGINE_FILES = {g: f"{ENGINE_DIR}/{g}.engine" for g in (TARGET, DRAFT_CONTEXT, DRAFT_BLOCK)}
PRECISIONS = ("fp32", "fp16", "bf16")
DTYPE_OF_PRECISION = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}

# ---------------------------------------------------------------------------------------
# 1. Profiles
# ---------------------------------------------------------------------------------------

# What every dynamic axis of every graph input means. Dims are matched by (graph, input,
# axis), not by the exporter's dim names, so a renamed dim cannot silently escape a profile.
BATCH, SEQ, PAST, CTX, PAST_CTX = "batch", "seq", "past", "ctx", "past_ctx"


def axis_role(graph: str, name: str, axis: int) -> str | None:
    """The profiled quantity an input axis carries, or None when the axis must be static."""
    if axis == 0:
        return BATCH
    if axis != 1:
        return None
    if graph == TARGET:
        return SEQ if name in ("input_ids", "position_ids") else PAST if name.startswith("past_") else None
    if graph == DRAFT_CONTEXT:
        return CTX if name in ("taps", "ctx_position_ids") else None
    if graph == DRAFT_BLOCK:
        return PAST_CTX if name.startswith("past_ctx_") else None  # the block axis is static K
    return None


@dataclass
class Profile:
    """One TensorRT optimization profile: (min, opt, max) for each profiled quantity."""

    name: str
    ranges: dict[str, tuple[int, int, int]]

    def shapes(self, spec: GraphSpec, graph: str) -> dict[str, tuple[tuple, tuple, tuple]]:
        """(min, opt, max) shape of every input of `spec`; static dims stay as they are."""
        out = {}
        for t in spec.inputs:
            lo, mid, hi = [], [], []
            for axis, d in enumerate(t.shape):
                if isinstance(d, int):
                    lo.append(d), mid.append(d), hi.append(d)
                    continue
                role = axis_role(graph, t.name, axis)
                if role is None or role not in self.ranges:
                    raise DFlashError(
                        f"{graph}: input {t.name} axis {axis} is dynamic ({d!r}) but no TensorRT profile covers it; "
                        "re-export with the current exporter"
                    )
                a, b, c = self.ranges[role]
                lo.append(a), mid.append(b), hi.append(c)
            out[t.name] = (tuple(lo), tuple(mid), tuple(hi))
        return out


@dataclass
class Limits:
    """The sequence limits engines are built for (recorded in the manifest's `engines`)."""

    block_size: int
    max_context: int
    max_prompt: int


def resolve_limits(manifest: Manifest, max_context: int | None = None, max_prompt: int | None = None) -> Limits:
    """Defaults and checks: max_context <= the export's, prompt + one block must fit."""
    k = manifest.block_size
    mc = manifest.max_context if max_context is None else int(max_context)
    if mc > manifest.max_context:
        raise DFlashError(
            f"--max-context {mc} exceeds the export's max_context {manifest.max_context}; "
            "re-export with a larger --max-context or lower it here"
        )
    if mc < k + 1:
        raise DFlashError(f"--max-context {mc} is too small for block size {k}: it must be at least {k + 1}")
    mp = max(1, mc // 2) if max_prompt is None else int(max_prompt)
    if mp < 1 or mp + k > mc:
        raise DFlashError(
            f"--max-prompt {mp} must be between 1 and max_context - block_size = {mc - k} "
            "(a full prompt plus one block has to fit in the context)"
        )
    return Limits(block_size=k, max_context=mc, max_prompt=mp)


def profiles(limits: Limits) -> dict[str, list[Profile]]:
    """The engines' optimization profiles, per graph, in profile-index order.

    target        0 verify:  seq exactly K,       past in [0, max_context - K]
                  1 prefill: seq in [1, max_prompt], past in [0, max_context - 1]
                    (covers chunked prefill and the 1-token steps of plain decoding)
    draft_context 0 context: ctx in [1, max(max_prompt, K)] (a prompt, or a round's a+1 <= K)
    draft_block   0 block:   past_ctx in [1, max_context - 1] (the anchor's position; K static;
                    near the end the loop still drafts a full block and discards the overhang)
    opt is the middle of each range, except verify's seq (K) and ctx (K: the per-round size).
    """
    k, mc, mp = limits.block_size, limits.max_context, limits.max_prompt

    def rng(lo: int, hi: int, opt: int | None = None) -> tuple[int, int, int]:
        return (lo, (lo + hi) // 2 if opt is None else opt, hi)

    one = (1, 1, 1)
    cmax = max(mp, k)
    return {
        TARGET: [
            Profile("verify", {BATCH: one, SEQ: (k, k, k), PAST: rng(0, mc - k)}),
            Profile("prefill", {BATCH: one, SEQ: rng(1, mp), PAST: rng(0, mc - 1)}),
        ],
        DRAFT_CONTEXT: [Profile("context", {BATCH: one, CTX: rng(1, cmax, min(k, cmax))})],
        DRAFT_BLOCK: [Profile("block", {BATCH: one, PAST_CTX: rng(1, mc - 1)})],
    }


def profile_record(manifest: Manifest, limits: Limits) -> dict[str, list[dict]]:
    """Profiles as JSON for the manifest: {graph: [{name, ranges, shapes{input: [min, opt, max]}}]}."""
    out = {}
    for graph, plist in profiles(limits).items():
        spec = manifest.graphs[graph]
        out[graph] = [
            {
                "name": p.name,
                "ranges": {r: list(v) for r, v in p.ranges.items()},
                "shapes": {n: [list(s) for s in mmo] for n, mmo in p.shapes(spec, graph).items()},
            }
            for p in plist
        ]
    return out


# ---------------------------------------------------------------------------------------
# ONNX Runtime's TensorRT execution provider (same profiles, one per graph)
# ---------------------------------------------------------------------------------------


def default_cache_dir(manifest: Manifest) -> Path:
    """Engine/timing cache of ORT's TensorRT provider: outside the exported directory.

    The exported directory is hash-verified (load_manifest refuses unlisted files), so the
    provider's cache lives under ~/.cache (or $DFLASH_TRT_CACHE), one folder per artifact.
    """
    base = Path(os.environ.get("DFLASH_TRT_CACHE") or Path.home() / ".cache" / "dflash-export" / "ort-trt")
    key = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(manifest.files.items())).encode()).hexdigest()[:16]
    return base / key


def _shape_str(shape: tuple) -> str:
    return "x".join(str(int(d)) for d in shape)


def ort_trt_provider_options(
    manifest: Manifest,
    graph: str,
    *,
    precision: str | None = None,
    max_context: int | None = None,
    max_prompt: int | None = None,
    cache_dir: str | Path | None = None,
    workspace_gb: float = 4.0,
    device_id: int = 0,
) -> dict:
    """Provider options for `TensorrtExecutionProvider` on one graph, from the manifest.

    ORT gets one explicit profile per graph (its options take min/opt/max per input): for
    the target the union of verify and prefill, with opt at the verify shape (the hot path).
    Engine and timing caches are enabled and kept in `cache_dir` (default: outside OUT).
    """
    precision = precision or manifest.dtype
    if precision not in PRECISIONS:
        raise DFlashError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    check_precision(manifest.dtype, precision)
    limits = resolve_limits(manifest, max_context, max_prompt)
    plist = profiles(limits)[graph]
    union = {}
    for p in plist:
        for role, (a, b, c) in p.ranges.items():
            if role in union:
                a0, b0, c0 = union[role]
                union[role] = (min(a, a0), b0, max(c, c0))  # opt of the first (verify) profile
            else:
                union[role] = (a, b, c)
    spec = manifest.graphs[graph]
    shapes = Profile("ort", union).shapes(spec, graph)
    dynamic = [t.name for t in spec.inputs if any(not isinstance(d, int) for d in t.shape)]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(manifest)
    opts = {
        "device_id": device_id,
        "trt_max_workspace_size": int(workspace_gb * (1 << 30)),
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(cache),
        "trt_fp16_enable": precision == "fp16",
    }
    if precision == "bf16":
        opts["trt_bf16_enable"] = True  # needs an ORT build whose TensorRT provider has this option
    if dynamic:
        for key, i in (("trt_profile_min_shapes", 0), ("trt_profile_opt_shapes", 1), ("trt_profile_max_shapes", 2)):
            opts[key] = ",".join(f"{n}:{_shape_str(shapes[n][i])}" for n in dynamic)
    return opts


def check_precision(export_dtype: str, precision: str) -> bool:
    """True when the engine can be strongly typed (precision == export dtype).

    A fp32 export may be built in fp16/bf16 (weakly typed, builder flag); the other way
    round would invent precision the graph does not have, so it is refused.
    """
    if precision == export_dtype:
        return True
    if export_dtype == "fp32":
        return False
    raise DFlashError(
        f"the graphs were exported in {export_dtype}; a {precision} engine needs a {precision} "
        f"(or fp32) export: re-run `dflash-export export --dtype {precision}` or build with --precision {export_dtype}"
    )


# ---------------------------------------------------------------------------------------
# 2. Engine record checks
# ---------------------------------------------------------------------------------------


def check_engine_record(record: dict | None, trt_version: str, compute_capability: str) -> None:
    """Refuse engines this process cannot run: missing, other TensorRT, other GPU arch.

    A serialized engine is only valid for the exact TensorRT version that built it and the
    GPU compute capability it was built on (TensorRT's portability rule; this project does
    not use version- or hardware-compatible engines).
    """
    if not record:
        raise DFlashError("this directory has no TensorRT engines; build them first with `dflash-export build OUT`")
    built = str(record.get("tensorrt", "?"))
    if built != trt_version:
        raise DFlashError(
            f"the engines were built with TensorRT {built} but this process has TensorRT {trt_version}; "
            f"rebuild them here with `dflash-export build OUT` (or install tensorrt=={built})"
        )
    cc = str(record.get("compute_capability", "?"))
    if cc != compute_capability:
        gpu = record.get("gpu", "another GPU")
        raise DFlashError(
            f"the engines were built for compute capability {cc} ({gpu}) but this GPU is {compute_capability}; "
            "engines do not move between GPU architectures: rebuild them on this machine with `dflash-export build OUT`"
        )


def import_tensorrt():
    """`tensorrt` and cuda-python's runtime module, or one DFlashError naming what is missing."""
    missing = []
    try:
        import tensorrt as trt
    except ImportError:
        trt = None
        missing.append("tensorrt")
    try:
        try:
            from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart  # older cuda-python
    except ImportError:
        cudart = None
        missing.append("cuda-python")
    if missing:
        raise DFlashError(f"TensorRT support needs the Python package(s) {', '.join(missing)}; install with: {INSTALL_HINT}")
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


# ---------------------------------------------------------------------------------------
# 3. The TensorRT backend (NOT EXECUTED in development: no TensorRT, no GPU there)
# ---------------------------------------------------------------------------------------

ALIGN = 256  # bytes: device addresses handed to TensorRT are kept 256-byte aligned


@dataclass
class _Engine:
    engine: object
    contexts: list  # one execution context per optimization profile
    graphs: dict = field(default_factory=dict)  # (profile, shape key) -> cudaGraphExec_t
    seen: dict = field(default_factory=dict)  # shape key -> times run without a graph
    capturable: bool = True


class TensorRTBackend(Backend):
    """Runs the three engines on one CUDA stream over device KV buffers it owns.

    KV buffers are sequence-major [1, max_len, Hkv, D] (as on ONNX Runtime): a call binds
    the valid prefix in place with set_tensor_address (no copy) and the graph's new K/V
    outputs are bound straight into the slots after it when that address is 256-byte
    aligned; otherwise they land in a scratch buffer and only those S rows are copied.

    CUDA graphs: a graph bakes in its shapes and addresses, and the past length changes
    every call, so graphs are keyed by the exact (S, past) of the static-shape calls
    (verify, draft block, decode step). A key is captured the second time it is run and
    replayed from the third on; that pays off when the same context lengths recur (repeated
    prompts in `bench`), not within one generation where each past length occurs once.
    """

    def __init__(self, out_dir: str | Path, manifest: Manifest | None = None, *, drafter: bool = True,
                 cuda_graphs: bool = True, max_graphs: int = 512, device: int = 0):
        trt, cudart = import_tensorrt()
        self.trt, self.cudart = trt, cudart
        self.out = Path(out_dir)
        self.manifest = m = manifest or load_manifest(self.out)
        cc, gpu = gpu_info(cudart, device)
        rec = m.engines
        check_engine_record(rec, trt.__version__, cc)
        self.record = rec
        self.k = m.block_size
        self.max_len = int(rec["max_context"])
        self.max_prompt = int(rec["max_prompt"])
        self.max_chunk = self.max_prompt  # longest `target` call other than verify; the loop chunks prefill by it
        self.cuda_graphs, self.max_graphs = cuda_graphs, max_graphs
        self.dtype = DTYPE_OF_PRECISION[m.dtype]
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

        L, H, D = m.target_layers, m.target_kv_heads, m.target_head_dim
        dl, dh, dd = m.draft_layers, m.draft_kv_heads, m.draft_head_dim
        self.row = H * D * self.esize  # bytes per position of one target K or V buffer
        self.drow = dh * dd * self.esize
        ms = max(self.max_prompt, self.k)
        self.kv = [(self._malloc(self.max_len * self.row), self._malloc(self.max_len * self.row)) for _ in range(L)]
        self.ckv = [(self._malloc(self.max_len * self.drow), self._malloc(self.max_len * self.drow))
                    for _ in range(dl if drafter else 0)]
        taps_w = int({t.name: t for t in m.graphs[TARGET].outputs}["taps"].shape[-1])
        self.taps_row = taps_w * self.esize
        self.d_ids, self.d_pos = self._malloc(ms * 8), self._malloc(ms * 8)
        self.d_next, self.d_logits = self._malloc(ms * 8), self._malloc(ms * m.vocab_size * 4)
        self.d_taps = self._malloc(ms * self.taps_row)
        self.d_cpos = self._malloc(ms * 8)
        self.d_bids, self.d_bpos = self._malloc(self.k * 8), self._malloc(self.k * 8)
        self.d_draft, self.d_dlogits = self._malloc(self.k * 8), self._malloc(self.k * m.vocab_size * 4)
        self.d_scratch = [self._malloc(ms * max(self.row, self.drow)) for _ in range(2 * max(L, dl))]
        self.h_ids, self.h_pos = np.zeros(ms, np.int64), np.zeros(ms, np.int64)
        self.h_next, self.h_logits = np.zeros(ms, np.int64), np.zeros((ms, m.vocab_size), np.float32)
        self.h_cpos = np.zeros(ms, np.int64)
        self.h_bids, self.h_bpos = np.zeros(self.k, np.int64), np.zeros(self.k, np.int64)
        self.h_draft = np.zeros(self.k, np.int64)
        self._taps_n = 0
        self.gpu = gpu
        self._check_io()

    def _check_io(self) -> None:
        """Every tensor this backend binds exists in the engine with the element size allocated for it."""
        trt, m = self.trt, self.manifest
        size = {trt.float32: 4, trt.float16: 2, trt.bfloat16: 2, trt.int64: 8, trt.int32: 4}
        for graph, e in self.eng.items():
            names = {e.engine.get_tensor_name(i) for i in range(e.engine.num_io_tensors)}
            spec = m.graphs[graph]
            for t in spec.inputs + spec.outputs:
                if t.name not in names:
                    raise DFlashError(f"{ENGINE_FILES[graph]} has no tensor {t.name}; rebuild the engines for this export")
                got = size.get(e.engine.get_tensor_dtype(t.name))
                if got != ITEMSIZE[t.dtype]:
                    raise DFlashError(f"{ENGINE_FILES[graph]}: {t.name} is {e.engine.get_tensor_dtype(t.name)} in the "
                                      f"engine but {t.dtype} in the manifest; rebuild the engines for this export")

    # -- setup ----------------------------------------------------------------------------

    def _load(self, graph: str, nprof: int) -> _Engine:
        path = self.out / ENGINE_FILES[graph]
        engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise DFlashError(f"{path}: TensorRT could not deserialize this engine; rebuild with `dflash-export build`")
        contexts = []
        for i in range(nprof):
            ctx = engine.create_execution_context()
            if i:
                ctx.set_optimization_profile_async(i, self.handle)
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
                raise DFlashError(f"internal: TensorRT refused shape {shape} for {name}; rebuild the engines")
        for name, ptr in addrs.items():
            if not ctx.set_tensor_address(name, ptr):
                raise DFlashError(f"internal: TensorRT refused the address of {name}")

    def _run(self, e: _Engine, prof: int, key: tuple, shapes: dict, addrs: dict, graphable: bool) -> None:
        """Enqueue one engine call: a captured CUDA graph when there is one, else execute_async_v3."""
        cudart = self.cudart
        gkey = (prof, key)
        if graphable and gkey in e.graphs:
            cuda_check(cudart.cudaGraphLaunch(e.graphs[gkey], self.stream))
            return
        ctx = e.contexts[prof]
        self._bind(ctx, shapes, addrs)
        if not ctx.execute_async_v3(self.handle):
            raise DFlashError("internal: TensorRT execute_async_v3 failed (see the TensorRT log above)")
        if not (graphable and self.cuda_graphs and e.capturable) or len(e.graphs) >= self.max_graphs:
            return
        e.seen[gkey] = e.seen.get(gkey, 0) + 1
        if e.seen[gkey] < 2:
            return
        # Shapes/addresses were set and enqueued once above (TensorRT's own rule before a
        # capture): now record the same enqueue into a graph, replayed from the next call on.
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal  # as in TensorRT's CUDA-graph example
        cuda_check(cudart.cudaStreamBeginCapture(self.stream, mode))
        ok = ctx.execute_async_v3(self.handle)
        err, graph = cudart.cudaStreamEndCapture(self.stream)
        if not ok or int(getattr(err, "value", err)) != 0:
            e.capturable = False  # this engine cannot be captured: keep running it directly
            return
        e.graphs[gkey] = cuda_check(cudart.cudaGraphInstantiate(graph, 0))
        cuda_check(cudart.cudaGraphDestroy(graph))

    def _out_addr(self, base: int, pos: int, row: int, scratch: int) -> tuple[int, bool]:
        """Address for new rows at `pos` of a cache buffer: in place if aligned, else scratch."""
        addr = base + pos * row
        return (addr, True) if addr % ALIGN == 0 else (scratch, False)

    # -- the Backend interface ------------------------------------------------------------

    def target(self, ids: np.ndarray, want_logits: bool = False) -> TargetOut:
        m, k = self.manifest, self.k
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        s, p = int(ids.size), self.target_len
        if s < 1:
            raise DFlashError("internal: target() needs at least one token")
        if p + s > self.max_len:
            raise DFlashError(f"sequence of {p + s} positions exceeds the engines' max context {self.max_len}; "
                              "rebuild with a larger `dflash-export build --max-context` or shorten the request")
        prof = 0 if s == k else 1
        if prof == 1 and s > self.max_prompt:
            raise DFlashError(f"a {s}-token chunk exceeds the engines' --max-prompt {self.max_prompt}; "
                              "prefill in chunks of at most that many tokens or rebuild with a larger --max-prompt")
        self.h_ids[:s] = ids
        self.h_pos[:s] = np.arange(p, p + s)
        self._h2d(self.d_ids, self.h_ids[:s])
        self._h2d(self.d_pos, self.h_pos[:s])
        H, D = m.target_kv_heads, m.target_head_dim
        shapes = {"input_ids": (1, s), "position_ids": (1, s)}
        addrs = {"input_ids": self.d_ids, "position_ids": self.d_pos, "logits": self.d_logits,
                 "next_ids": self.d_next, "taps": self.d_taps}
        copies = []
        for i, (kb, vb) in enumerate(self.kv):
            for nm, base, scr in ((f"key.{i}", kb, self.d_scratch[2 * i]), (f"value.{i}", vb, self.d_scratch[2 * i + 1])):
                shapes[f"past_{nm}"] = (1, p, H, D)
                addrs[f"past_{nm}"] = base
                addr, inplace = self._out_addr(base, p, self.row, scr)
                addrs[f"new_{nm}"] = addr
                if not inplace:
                    copies.append((base + p * self.row, scr, s * self.row))
        self._run(self.eng[TARGET], prof, (s, p), shapes, addrs, graphable=(s == k or s == 1))
        for dst, src, n in copies:
            self._d2d(dst, src, n)
        self._d2h(self.h_next[:s], self.d_next)
        if want_logits:
            self._d2h(self.h_logits[:s], self.d_logits)
        self._sync()
        self._pending = s
        self._taps_n = s
        return TargetOut(next_ids=self.h_next[:s], logits=self.h_logits[:s] if want_logits else None)

    def draft_context(self, n: int) -> None:
        m = self.manifest
        c, p = int(n), self.context_len
        if not 0 < c <= self._taps_n:
            raise DFlashError(f"internal: draft_context({c}) but the last target call kept {self._taps_n} taps")
        if p + c > self.max_len:
            raise DFlashError(f"drafter context of {p + c} positions exceeds the engines' max context {self.max_len}")
        self.h_cpos[:c] = np.arange(p, p + c)
        self._h2d(self.d_cpos, self.h_cpos[:c])
        dh, dd = m.draft_kv_heads, m.draft_head_dim
        shapes = {"taps": (1, c, self.taps_row // self.esize), "ctx_position_ids": (1, c)}
        addrs = {"taps": self.d_taps, "ctx_position_ids": self.d_cpos}
        copies = []
        for j, (kb, vb) in enumerate(self.ckv):
            for nm, base, scr in ((f"key.{j}", kb, self.d_scratch[2 * j]), (f"value.{j}", vb, self.d_scratch[2 * j + 1])):
                addr, inplace = self._out_addr(base, p, self.drow, scr)
                addrs[f"ctx_{nm}"] = addr
                if not inplace:
                    copies.append((base + p * self.drow, scr, c * self.drow))
        self._run(self.eng[DRAFT_CONTEXT], 0, (c, p), shapes, addrs, graphable=False)
        for dst, src, nb in copies:
            self._d2d(dst, src, nb)
        self._sync()
        self.context_len += c

    def draft_block(self, anchor: int) -> np.ndarray:
        m, k = self.manifest, self.k
        p = self.context_len
        if p < 1:
            raise DFlashError("internal: draft_block() before any context (prefill first)")
        if p >= self.max_len:
            raise DFlashError(f"a block at position {p} is past the engines' max context {self.max_len}")
        self.h_bids[0] = int(anchor)
        self.h_bids[1:] = m.mask_token_id
        self.h_bpos[:] = np.arange(p, p + k)
        self._h2d(self.d_bids, self.h_bids)
        self._h2d(self.d_bpos, self.h_bpos)
        dh, dd = m.draft_kv_heads, m.draft_head_dim
        shapes = {"block_ids": (1, k), "block_position_ids": (1, k)}
        addrs = {"block_ids": self.d_bids, "block_position_ids": self.d_bpos,
                 "draft_ids": self.d_draft, "draft_logits": self.d_dlogits}
        for j, (kb, vb) in enumerate(self.ckv):
            shapes[f"past_ctx_key.{j}"] = shapes[f"past_ctx_value.{j}"] = (1, p, dh, dd)
            addrs[f"past_ctx_key.{j}"], addrs[f"past_ctx_value.{j}"] = kb, vb
        self._run(self.eng[DRAFT_BLOCK], 0, (k, p), shapes, addrs, graphable=True)
        self._d2h(self.h_draft[: k - 1], self.d_draft)
        self._sync()
        return self.h_draft[: k - 1]

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        cudart = getattr(self, "cudart", None)
        if cudart is None:
            return
        for e in getattr(self, "eng", {}).values():
            for g in e.graphs.values():
                cudart.cudaGraphExecDestroy(g)
            e.graphs.clear()
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
