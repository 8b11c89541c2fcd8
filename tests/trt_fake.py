"""SIMULATED behaviour behind the TensorRT test double, and a stand-in for cuda-python.

Everything in this file is hand-written and is NOT TensorRT. The interface the project's code
and Polygraphy see is the real one (tests/trt_double.py checks every attribute, call, argument
and return value against the real bindings of tests/trt_bindings.py); this file only supplies
what the library would do behind it, as much as the tests need:
- the parser reads the ONNX graph's inputs (names, dtypes, shapes), no nodes (a network
  without layers); a missing file fails the parse;
- the builder checks each profile covers every input (TensorRT's rule), calls the progress
  monitor, appends to the timing cache and serializes a JSON "plan" (ONNX path, profiles,
  flags, TensorRT version);
- the runtime refuses a plan that is not such JSON or was built by another version (None, as
  TensorRT returns); an "engine" runs its ONNX graph with ONNX Runtime on CPU;
- a context refuses shapes outside its profile and addresses not 256-byte aligned (False).
"Device memory" is host memory (the cudart stand-in below); cuda-python is not TensorRT and
its real calls need a driver, so it stays hand-written.
"""

from __future__ import annotations

import ctypes
import json
import types
from enum import IntEnum
from pathlib import Path

import numpy as np

# -- cuda-python's runtime module (SIMULATED: host memory plays device memory) -----------

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


def _memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
    """cudaMemcpy2DAsync: `height` rows of `width` bytes. CUDA's rules: width <= both pitches, and
    the two areas may not overlap (an error code here, undefined behaviour on a GPU)."""
    dst, dpitch, src, spitch, width, height = (int(x) for x in (dst, dpitch, src, spitch, width, height))
    if width > min(dpitch, spitch) or width < 0 or height < 0:
        return (1,)  # cudaErrorInvalidValue
    if height and dst < src + (height - 1) * spitch + width and src < dst + (height - 1) * dpitch + width:
        return (1,)
    for i in range(height):
        ctypes.memmove(dst + i * dpitch, src + i * spitch, width)
    return (0,)


def _props(dev):
    return 0, types.SimpleNamespace(major=9, minor=0, name=b"Fake GPU (numpy)")


cudart = types.SimpleNamespace(
    cudaMemcpyKind=_Kind,
    cudaGetDeviceCount=lambda: (0, 1), cudaGetDeviceProperties=_props, cudaSetDevice=lambda d: (0,),
    cudaStreamCreate=lambda: (0, _Stream()), cudaStreamDestroy=lambda s: (0,), cudaStreamSynchronize=lambda s: (0,),
    cudaMalloc=_malloc, cudaFree=lambda p: (_mem.pop(int(p), None), 0)[1:], cudaMemcpyAsync=_memcpy,
    cudaMemcpy2DAsync=_memcpy2d,
)

# -- what TensorRT would do (SIMULATED) ------------------------------------------------------
# Each class stands behind one real class (the name after Sim); its methods carry the real
# members' names and parameter names (tests/test_trt_conformance.py checks them).

builds: list[dict] = []  # every build_serialized_network call, for the tests to inspect


def sim(proxy):
    """The simulated object behind a double's proxy."""
    return object.__getattribute__(proxy, "_sim")


def _dtypes(trt):
    return {1: trt.float32, 10: trt.float16, 16: trt.bfloat16, 7: trt.int64, 6: trt.int32}


class SimITensor:
    def __init__(self, trt, vi):
        t = vi.type.tensor_type
        self.name, self.dtype, self.is_shape_tensor = vi.name, _dtypes(trt)[t.elem_type], False
        self.shape = trt.Dims([d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim])


class SimINetworkDefinition:
    def __init__(self, trt, flags):
        self.trt, self.flags, self.path, self.inputs = trt, flags, None, []

    @property
    def num_inputs(self):
        return len(self.inputs)

    def get_input(self, index):
        return self.inputs[index]

    def get_flag(self, flag):
        return bool(self.flags & (1 << int(flag)))

    def __len__(self):  # layers: the simulation parses no ONNX nodes
        return 0

    def __getitem__(self, arg0):
        raise IndexError(arg0)


class SimParserError:
    def __init__(self, msg):
        self.msg = msg

    def desc(self):
        return self.msg

    def __str__(self):
        return self.msg


class SimOnnxParser:
    def __init__(self, trt, network, logger):
        self.trt, self.network, self.errors = trt, sim(network), []

    @property
    def num_errors(self):
        return len(self.errors)

    def parse_from_file(self, model):
        import onnx

        if not Path(model).is_file():
            self.errors.append(SimParserError(f"{model}: no such file"))
            return False
        m = onnx.load(model, load_external_data=False)
        inits = {i.name for i in m.graph.initializer}
        self.network.path = model
        self.network.inputs = [SimITensor(self.trt, vi) for vi in m.graph.input if vi.name not in inits]
        return True

    def get_error(self, index):
        return self.errors[index]


class SimIOptimizationProfile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, input, min, opt, max):  # noqa: A002 - the real parameter names
        lo, mid, hi = (tuple(int(x) for x in d) for d in (min, opt, max))
        if not (len(lo) == len(mid) == len(hi) and all(a <= b <= c for a, b, c in zip(lo, mid, hi))):
            raise ValueError(f"set_shape({input}): min <= opt <= max violated")  # TensorRT logs and ignores; be loud
        self.shapes[input] = [list(lo), list(mid), list(hi)]

    def __bool__(self):
        return bool(self.shapes)


class SimITimingCache:
    def __init__(self, data):
        self.data = bytes(data)

    def combine(self, input_cache, ignore_mismatch):
        other = sim(input_cache).data
        self.data = other + self.data[len(other):] if self.data.startswith(other) else other + self.data
        return True

    def serialize(self):
        return self.data


class SimIBuilderConfig:
    def __init__(self, trt):
        self.trt = trt
        self.DLA_core, self.default_device_type = -1, trt.DeviceType.GPU
        self.engine_capability = trt.EngineCapability.STANDARD
        self.profiling_verbosity = trt.ProfilingVerbosity.LAYER_NAMES_ONLY
        self.progress_monitor = None
        self.int8_calibrator = None  # 10.x only: the double refuses it on 11.x, as the real class lacks it
        self.profiles, self.flags, self.pool, self.cache = [], set(), {}, None

    @property
    def num_optimization_profiles(self):
        return len(self.profiles)

    def set_memory_pool_limit(self, pool, pool_size):
        self.pool[pool.name] = pool_size

    def get_memory_pool_limit(self, pool):
        return self.pool.get(pool.name, 0)

    def set_flag(self, flag):
        self.flags.add(flag.name)

    def clear_flag(self, flag):
        self.flags.discard(flag.name)

    def get_flag(self, flag):
        return flag.name in self.flags

    def get_tactic_sources(self):
        return 0

    def get_preview_feature(self, feature):
        return False

    def get_quantization_flag(self, flag):
        return False

    def add_optimization_profile(self, profile):
        self.profiles.append(sim(profile).shapes)
        return len(self.profiles) - 1

    def create_timing_cache(self, serialized_timing_cache):
        return SimITimingCache(serialized_timing_cache)

    def set_timing_cache(self, cache, ignore_mismatch):
        self.cache = sim(cache)
        return True

    def get_timing_cache(self):
        return self.cache


class SimBuilder:
    def __init__(self, trt, logger):
        self.trt = trt

    def create_network(self, flags=0):
        return SimINetworkDefinition(self.trt, flags)

    def create_builder_config(self):
        return SimIBuilderConfig(self.trt)

    def create_optimization_profile(self):
        return SimIOptimizationProfile()

    def build_serialized_network(self, network, config):
        net, cfg = sim(network), sim(config)
        for prof in cfg.profiles:  # TensorRT's rule: every input has a range in every profile, static dims fixed
            for inp in net.inputs:
                lo, _, hi = prof[inp.name]
                assert len(lo) == len(inp.shape) and all(d == -1 or a == d == b for d, a, b in zip(inp.shape, lo, hi))
        m = cfg.progress_monitor
        if m is not None:  # called as TensorRT's trampoline calls it: positionally, the real parameter types
            m.phase_start("Building engine", None, 2)
            m.step_complete("Building engine", 0)
            m.step_complete("Building engine", 1)
            m.phase_finish("Building engine")
        cfg.cache.data += b"+"  # this build's timings
        rec = {"onnx": str(net.path), "profiles": cfg.profiles, "flags": sorted(cfg.flags),
               "network_flags": net.flags, "workspace": cfg.pool.get("WORKSPACE"), "tensorrt": self.trt.__version__}
        builds.append(rec)
        return json.dumps(rec).encode()


class SimRuntime:
    def __init__(self, trt, logger):
        self.trt = trt

    def deserialize_cuda_engine(self, serialized_engine):
        try:
            rec = json.loads(bytes(serialized_engine))
        except (ValueError, UnicodeDecodeError):
            return None  # TensorRT logs an error and returns None
        if not isinstance(rec, dict) or rec.get("tensorrt") != self.trt.__version__:
            return None  # a plan of another TensorRT version is refused the same way
        return SimICudaEngine(self.trt, rec)


class SimICudaEngine:
    def __init__(self, trt, rec):
        import onnxruntime as ort

        self.trt, self.rec = trt, rec
        self.sess = ort.InferenceSession(rec["onnx"], providers=["CPUExecutionProvider"])
        self.inputs = [a.name for a in self.sess.get_inputs()]
        self.outputs = [a.name for a in self.sess.get_outputs()]
        self.io = {a.name: a for a in self.sess.get_inputs() + self.sess.get_outputs()}
        by_ort = {"tensor(float)": 1, "tensor(float16)": 10, "tensor(bfloat16)": 16, "tensor(int64)": 7, "tensor(int32)": 6}
        self.dtype = {n: _dtypes(trt)[by_ort[a.type]] for n, a in self.io.items()}

    @property
    def num_io_tensors(self):
        return len(self.io)

    @property
    def num_optimization_profiles(self):
        return len(self.rec["profiles"])

    def get_tensor_name(self, index):
        return list(self.io)[index]

    def get_tensor_dtype(self, name):
        return self.dtype[name]

    def get_tensor_mode(self, name):
        m = self.trt.TensorIOMode
        return m.INPUT if name in self.inputs else m.OUTPUT if name in self.outputs else m.NONE

    def get_tensor_profile_shape(self, name, profile_index):
        return [self.trt.Dims(s) for s in self.rec["profiles"][profile_index][name]]

    def create_execution_context(self):
        return SimIExecutionContext(self)


def _view(addr, dtype, shape):
    n = int(np.prod(shape)) * dtype.itemsize
    if n == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer((ctypes.c_char * n).from_address(addr), dtype=dtype).reshape(shape)


class SimIExecutionContext:
    def __init__(self, engine):
        self.e, self.profile, self.shapes, self.addrs = engine, 0, {}, {}
        self.refuse_profile = False  # a test sets it to see set_optimization_profile_async fail

    def set_optimization_profile_async(self, profile_index, stream_handle):
        if self.refuse_profile or not 0 <= profile_index < len(self.e.rec["profiles"]):
            return False
        self.profile = profile_index
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.e.rec["profiles"][self.profile][name]
        shape = tuple(int(x) for x in shape)
        if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False  # outside this context's optimization profile, as TensorRT refuses
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name, memory):
        if name not in self.e.io or memory % 256:
            return False
        self.addrs[name] = memory
        return True

    def execute_async_v3(self, stream_handle):
        if set(self.e.inputs) - set(self.shapes) or set(self.e.io) - set(self.addrs):
            return False  # an unset shape or address: TensorRT refuses the enqueue
        np_type = {v: np.dtype(k) for k, v in {"float32": self.e.trt.float32, "float16": self.e.trt.float16,
                                                 "int64": self.e.trt.int64, "int32": self.e.trt.int32}.items()}
        feeds = {n: _view(self.addrs[n], np_type[self.e.dtype[n]], self.shapes[n]).copy() for n in self.e.inputs}
        for n, v in zip(self.e.outputs, self.e.sess.run(self.e.outputs, feeds)):
            _view(self.addrs[n], v.dtype, v.shape)[...] = v
        return True


FACTORIES = {"Builder": SimBuilder, "Runtime": SimRuntime, "OnnxParser": SimOnnxParser}
FUNCTIONS = {"init_libnvinfer_plugins": lambda logger, namespace: True}


def install(monkeypatch, version: str | None = None) -> types.ModuleType:
    """Make `import tensorrt` the double of the real TensorRT `version` (default: the newest
    pinned one) and `from cuda.bindings import runtime` the stand-in above; skip or fail the
    test (tests/trt_bindings.py: require) where the real bindings are missing."""
    import sys

    import trt_bindings
    from trt_double import double, forget_polygraphy_tensorrt

    version = version or trt_bindings.VERSIONS[-1]
    trt_bindings.require(version)
    trt = double(version)
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    runtime = types.ModuleType("cuda.bindings.runtime")
    runtime.__dict__.update(vars(cudart))
    bindings.runtime, cuda.bindings = runtime, bindings
    for name, mod in (("tensorrt", trt), ("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, mod)
    forget_polygraphy_tensorrt(monkeypatch)
    builds.clear()
    return trt
