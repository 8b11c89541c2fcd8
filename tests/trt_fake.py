"""A stand-in for the `tensorrt` and cuda-python modules, built on numpy + ONNX Runtime (CPU).

It is NOT TensorRT. It lets the build and backend code in export/trt_build.py and runtime/trt_backend.py
run here, where neither TensorRT nor a GPU exists, so that our own bookkeeping is tested:
which profiles are declared, which shapes each call sets (refused outside the context's
profile, as TensorRT does), which addresses are bound (refused unless 256-byte aligned),
KV offsets and copies. It mirrors the TensorRT 11.x Python API (no weak-typing builder
flags), enough of it that the real Polygraphy loaders run the build against it. "Device
memory" is host memory; an "engine" is a JSON record of the ONNX path and profiles, run by
an ORT session.
"""

from __future__ import annotations

import ctypes
import json
import types
from enum import IntEnum
from pathlib import Path

import numpy as np
import onnxruntime as ort

# -- cuda-python's runtime module --------------------------------------------------------

_mem: dict[int, np.ndarray] = {}


class _Kind(IntEnum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class _Stream:
    _n = 0

    def __init__(self):
        _Stream._n += 1
        self.h = 0x1000 + _Stream._n

    def __int__(self):
        return self.h


def _malloc(n):
    buf = np.zeros(int(n) + 512, np.uint8)
    addr = buf.ctypes.data
    addr += (-addr) % 256  # cudaMalloc returns 256-byte aligned memory
    _mem[addr] = buf
    return 0, addr


def _memcpy(dst, src, n, kind, stream):
    ctypes.memmove(int(dst), int(src), int(n))
    return (0,)


def _props(dev):
    return 0, types.SimpleNamespace(major=9, minor=0, name=b"Fake GPU (numpy)")


cudart = types.SimpleNamespace(
    cudaMemcpyKind=_Kind,
    cudaGetDeviceCount=lambda: (0, 1), cudaGetDeviceProperties=_props, cudaSetDevice=lambda d: (0,),
    cudaStreamCreate=lambda: (0, _Stream()), cudaStreamDestroy=lambda s: (0,), cudaStreamSynchronize=lambda s: (0,),
    cudaMalloc=_malloc, cudaFree=lambda p: (_mem.pop(int(p), None), 0)[1:], cudaMemcpyAsync=_memcpy,
)

# -- tensorrt (the 11.x Python API: no weak-typing builder flags) -------------------------


class DataType:
    def __init__(self, name, np_dtype):
        self.name, self.np = name, np.dtype(np_dtype)

    def __repr__(self):
        return f"DataType.{self.name}"


float32, float16, bfloat16 = DataType("FLOAT", np.float32), DataType("HALF", np.float16), DataType("BF16", np.uint16)
int64, int32 = DataType("INT64", np.int64), DataType("INT32", np.int32)
_FROM_ORT = {"tensor(float)": float32, "tensor(float16)": float16, "tensor(bfloat16)": bfloat16,
             "tensor(int64)": int64, "tensor(int32)": int32}
_FROM_ONNX = {1: float32, 10: float16, 16: bfloat16, 7: int64, 6: int32}


class ILogger:
    def __init__(self):
        pass


class Logger(ILogger):
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self, level=None):
        self.level = level


def init_libnvinfer_plugins(logger, namespace):
    return True


class NetworkDefinitionCreationFlag(IntEnum):
    STRONGLY_TYPED = 0  # 11.x: deprecated and ignored (always strongly typed)


class MemoryPoolType(IntEnum):
    WORKSPACE = 0


class BuilderFlag(IntEnum):  # 11.x: FP16, BF16, INT8, FP8, INT4, FP4, *_PRECISION_CONSTRAINTS removed
    DEBUG = 2
    TF32 = 6


class DeviceType(IntEnum):
    GPU = 0
    DLA = 1


class IProgressMonitor:
    def __init__(self):
        pass


builds: list[dict] = []  # every build_serialized_network call, for the tests to inspect


class _Input:
    def __init__(self, vi):
        t = vi.type.tensor_type
        self.name, self.dtype, self.is_shape_tensor = vi.name, _FROM_ONNX[t.elem_type], False
        self.shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)


class _Network:
    def __init__(self, flags):
        self.flags, self.path, self.inputs = flags, None, []

    @property
    def num_inputs(self):
        return len(self.inputs)

    def get_input(self, i):
        return self.inputs[i]

    def __iter__(self):  # the layers: this stand-in parses no ONNX nodes
        return iter(())


class OnnxParser:
    def __init__(self, network, logger):
        self.network, self.num_errors = network, 0

    def parse_from_file(self, path):
        import onnx

        if not Path(path).is_file():
            return False
        model = onnx.load(path, load_external_data=False)
        inits = {i.name for i in model.graph.initializer}
        self.network.path = path
        self.network.inputs = [_Input(vi) for vi in model.graph.input if vi.name not in inits]
        return True

    def get_error(self, i):
        return "fake parse error"


class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, min, opt, max):
        assert all(a <= b <= c for a, b, c in zip(min, opt, max)), (name, min, opt, max)
        self.shapes[name] = [list(min), list(opt), list(max)]

    def __bool__(self):
        return bool(self.shapes)


class _HostMemory(bytes):  # IHostMemory: a buffer, and a context manager in the Python API
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _TimingCache:
    def __init__(self, data):
        self.data = bytes(data)

    def combine(self, other, ignore_mismatch):
        self.data = other.data + self.data[len(other.data):] if self.data.startswith(other.data) else other.data + self.data
        return True

    def serialize(self):
        return _HostMemory(self.data)


class _Config:
    DLA_core, default_device_type = -1, DeviceType.GPU

    def __init__(self):
        self.profiles, self.flags, self.pool, self.cache, self.progress_monitor = [], set(), {}, None, None

    @property
    def num_optimization_profiles(self):
        return len(self.profiles)

    def set_memory_pool_limit(self, pool, n):
        self.pool[int(pool)] = n

    def get_memory_pool_limit(self, pool):
        return self.pool.get(int(pool), 0)

    def set_flag(self, flag):
        self.flags.add(BuilderFlag(flag).name)

    def clear_flag(self, flag):
        self.flags.discard(BuilderFlag(flag).name)

    def get_flag(self, flag):
        return BuilderFlag(flag).name in self.flags

    def add_optimization_profile(self, p):
        self.profiles.append(p.shapes)
        return len(self.profiles) - 1

    def create_timing_cache(self, data):
        return _TimingCache(data)

    def set_timing_cache(self, cache, ignore_mismatch):
        self.cache = cache
        return True

    def get_timing_cache(self):
        return self.cache


class Builder:
    def __init__(self, logger):
        pass

    def create_network(self, flags=0):
        return _Network(flags)

    def create_builder_config(self):
        return _Config()

    def create_optimization_profile(self):
        return _Profile()

    def build_serialized_network(self, network, config):
        for prof in config.profiles:  # TensorRT's rule: every dynamic input has a range in every profile
            for inp in network.inputs:
                lo, _, hi = prof[inp.name]
                assert len(lo) == len(inp.shape) and all(d == -1 or a == d == b for d, a, b in zip(inp.shape, lo, hi))
        if config.progress_monitor is not None:
            m = config.progress_monitor
            m.phase_start("Building engine", None, 2)
            m.step_complete("Building engine", 0)
            m.step_complete("Building engine", 1)
            m.phase_finish("Building engine")
        config.cache.data += b"+"  # this build's timings
        rec = {"onnx": str(network.path), "profiles": config.profiles, "flags": sorted(config.flags),
               "network_flags": network.flags, "workspace": config.pool.get(0)}
        builds.append(rec)
        return _HostMemory(json.dumps(rec).encode())


class Runtime:
    def __init__(self, logger):
        pass

    def deserialize_cuda_engine(self, blob):
        return _Engine(json.loads(bytes(blob)))


class _Engine:
    def __init__(self, rec):
        self.rec = rec
        self.sess = ort.InferenceSession(rec["onnx"], providers=["CPUExecutionProvider"])
        self.io = {a.name: a for a in self.sess.get_inputs() + self.sess.get_outputs()}
        self.inputs = [a.name for a in self.sess.get_inputs()]
        self.outputs = [a.name for a in self.sess.get_outputs()]
        self.num_io_tensors = len(self.io)

    def get_tensor_name(self, i):
        return list(self.io)[i]

    def get_tensor_dtype(self, name):
        return _FROM_ORT[self.io[name].type]

    def create_execution_context(self):
        return _Context(self)


def _view(addr, dtype, shape):
    n = int(np.prod(shape)) * dtype.itemsize
    if n == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer((ctypes.c_char * n).from_address(addr), dtype=dtype).reshape(shape)


class _Context:
    runs = 0  # executed enqueues, all contexts

    def __init__(self, engine):
        self.e, self.profile, self.shapes, self.addrs = engine, 0, {}, {}

    def set_optimization_profile_async(self, i, stream):
        assert isinstance(stream, int)
        self.profile = i
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.e.rec["profiles"][self.profile][name]
        if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False  # outside this context's optimization profile, as TensorRT refuses
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        if name not in self.e.io or ptr % 256:
            return False
        self.addrs[name] = ptr
        return True

    def execute_async_v3(self, stream):
        assert isinstance(stream, int)
        shapes, addrs = dict(self.shapes), dict(self.addrs)

        def run():
            feeds = {n: _view(addrs[n], _FROM_ORT[self.e.io[n].type].np, shapes[n]).copy() for n in self.e.inputs}
            outs = self.e.sess.run(self.e.outputs, feeds)
            for n, v in zip(self.e.outputs, outs):
                _view(addrs[n], v.dtype, v.shape)[...] = v
            _Context.runs += 1

        run()
        return True


__version__ = "11.5.0+fake"


def install(monkeypatch) -> types.ModuleType:
    """Make `import tensorrt` and `from cuda.bindings import runtime` return these fakes."""
    import sys

    trt = sys.modules[__name__]
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    runtime = types.ModuleType("cuda.bindings.runtime")
    runtime.__dict__.update(vars(cudart))
    bindings.runtime, cuda.bindings = runtime, bindings
    for name, mod in (("tensorrt", trt), ("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, mod)
    builds.clear()
    return trt
