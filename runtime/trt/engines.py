"""TensorRT's side of a built directory: the engines (one execution context per optimization
profile), checked against the manifest's build record and the graph contract, each call enqueued
on the backend's CUDA stream; and what every TensorRT user here checks first: the supported
TensorRT versions, the imports and CUDA calls, and the exports TensorRT cannot build.

NOT YET EXECUTED ON TENSORRT HARDWARE: it needs `tensorrt`, `cuda-python` and an NVIDIA GPU.
The test suite runs it against a double of the real TensorRT 10.12 and 11.4 Python bindings
(tests/trt_double.py); on a GPU machine tests/test_trt_gpu.py runs it for real.

`tensorrt` and `cuda` are imported inside functions only: importing this module needs numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import contract as C
from ..contract import DRAFT_BLOCK, DRAFT_CONTEXT, TARGET
from ..errors import DFlashError, InternalError
from ..files import read_bytes
from ..manifest import Manifest

# Supported TensorRT: >= 10.12 (the release that deprecated weak typing; from it on the same
# strongly typed build and runtime code serves 10.x and 11.x) and < 12. Same range as the
# `trt` extra in pyproject.toml.
TRT_MIN, TRT_BELOW = (10, 12), (12, 0)
ENGINE_DIR = "engines"
ENGINE_FILES = {g: f"{ENGINE_DIR}/{g}.engine" for g in (TARGET, DRAFT_CONTEXT, DRAFT_BLOCK)}

INSTALL_HINT = 'pip install "dflash-export[trt]" (or: pip install tensorrt cuda-python --extra-index-url https://pypi.nvidia.com)'
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}


def trt_version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a TensorRT version string such as "11.5.0.12"."""
    parts = [p for p in str(version).split(".")[:2]]
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise DFlashError(f"cannot read the TensorRT version {version!r}") from None


def check_trt_version(version: str) -> None:
    """Refuse a TensorRT outside the supported range, naming the range."""
    v = trt_version_tuple(version)
    if not TRT_MIN <= v < TRT_BELOW:
        lo, hi = ".".join(map(str, TRT_MIN)), TRT_BELOW[0]
        raise DFlashError(f"TensorRT {version} is not supported: this version of dflash-export needs "
                          f'TensorRT >= {lo}, < {hi} (pip install "dflash-export[trt]")')


def refuse_quantized(manifest: Manifest) -> None:
    """Weight-only quantized graphs hold ONNX Runtime's MatMulNBits, which TensorRT's parser does not take; a
    quantized --moe standard target also gathers uint8 expert codes, which TensorRT's gathers do not take
    (export/moe.py `to_gathered`; the onnx-tensorrt operator list, export/trt_ops.json). Not tried on a GPU."""
    q = manifest.quantization
    if q is not None and q.get("target", True) and (manifest.moe or {}).get("path") == "standard":
        raise DFlashError(f"this export is quantized ({q['scheme']}: the linear layers as ONNX Runtime MatMulNBits, the "
                          "routed experts as uint8 codes gathered per token), which TensorRT cannot build: its parser takes "
                          "no MatMulNBits, and its Gather / GatherND and Reshape no 8-bit integers (UINT8 is a network "
                          "input/output type only, INT8 a Q/DQ type); build from the float --moe standard export")
    if q is not None:
        raise DFlashError(f"this export is quantized ({q['scheme']} weights as ONNX Runtime MatMulNBits), which TensorRT "
                          "cannot parse (TensorRT quantizes through Q/DQ nodes, which dflash-export does not write); build from an export "
                          "without --quantize")


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
            f"rebuild them with this TensorRT: `dflash-export build OUT` (or install tensorrt=={built})"
        )
    cc = str(record.get("compute_capability", "?"))
    if cc != compute_capability:
        gpu = record.get("gpu", "another GPU")
        raise DFlashError(
            f"the engines were built for compute capability {cc} ({gpu}) but this GPU is {compute_capability}; "
            "engines do not move between GPU architectures: rebuild them on this GPU with `dflash-export build OUT`"
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


@dataclass
class _Engine:
    engine: object
    contexts: list  # one execution context per optimization profile


class Engines:
    """The deserialized engines of `graphs`, checked at load: every tensor the backend binds
    exists with the element size it allocates, every profile is the manifest's record."""

    def __init__(self, trt, out: Path, manifest: Manifest, record: dict, graphs: tuple, handle: int, sync):
        self.trt, self.out, self.manifest, self.record, self.handle = trt, out, manifest, record, handle
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.eng = {g: self._load(g, len(record["profiles"][g]), sync) for g in graphs}
        self.inputs = {g: C.io(g, manifest)[0] for g in graphs}  # the contract's inputs, in order
        self._check_io()

    def _load(self, graph: str, nprof: int, sync) -> _Engine:
        path = self.out / ENGINE_FILES[graph]
        engine = self._runtime.deserialize_cuda_engine(read_bytes(path, "rebuild with `dflash-export build`"))
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
        sync()
        return _Engine(engine, contexts)

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

    @staticmethod
    def _bind(ctx, shapes: dict[str, tuple], addrs: dict[str, int]) -> None:
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise InternalError(f"TensorRT refused shape {shape} for {name}; rebuild the engines")
        for name, ptr in addrs.items():
            if not ctx.set_tensor_address(name, ptr):
                raise InternalError(f"TensorRT refused the address of {name}")

    def run(self, graph: str, prof: int, addrs: dict, **dynamic: int) -> None:
        """Enqueue one engine call on the stream (execute_async_v3); input shapes from the contract."""
        ctx = self.eng[graph].contexts[prof]
        shapes = {t.name: C.shape(t, self.manifest, **({"batch": 1} | dynamic)) for t in self.inputs[graph]}
        self._bind(ctx, shapes, addrs)
        if not ctx.execute_async_v3(self.handle):
            raise InternalError("TensorRT execute_async_v3 failed (see the TensorRT log above)")

    def close(self) -> None:
        for e in self.eng.values():
            e.contexts.clear()
        self.eng = {}
