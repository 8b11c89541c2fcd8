"""A `tensorrt` test double derived from the REAL TensorRT Python bindings (tests/trt_bindings.py).

What is real: the module itself. Enums, `Dims`, `DataType`, `Logger`, `ILogger`,
`IProgressMonitor`, `__version__` and every other name are NVIDIA's objects, taken as they are.
What is checked against the real classes: every object the library would create (Builder,
IBuilderConfig, INetworkDefinition, ITensor, OnnxParser, IOptimizationProfile, ITimingCache,
IHostMemory, Runtime, ICudaEngine, IExecutionContext, ...) is a `Checked` proxy that
- refuses an attribute the real class does not have (AttributeError, as the real one would);
- checks every call against the real member's signature, parsed from its pybind11 `__doc__`
  (every overload): arity, keyword names (pybind11's unnamed `argN` are positional only),
  argument types with pybind11's conversions (an int is not an enum, a float is not an int, a
  tuple of ints is a `Dims`, ...), refusing with TypeError like pybind11;
- refuses writes to read-only properties and checks a written value's type;
- checks each return value against the real annotation (None only where the docs say the call
  can return None), and wraps returned library objects in a proxy of the annotated class.
What is simulated (tests/trt_fake.py, hand-written and marked so): what the library would DO
behind those calls: parse the ONNX inputs, record profiles into a plan, run the "engine" with
ONNX Runtime. A member the simulation lacks raises NotSimulated, never AttributeError (which
Polygraphy treats as "not in this TensorRT version" and would hide).
"""

from __future__ import annotations

import importlib.machinery
import re
import types
from dataclasses import dataclass, replace
from functools import lru_cache

PREFIXES = ("typing_extensions.", "typing.", "collections.abc.")
# module and C++ namespace prefixes: tensorrt_bindings.tensorrt., _tensorrt_11_4_0_106.tensorrt., nvinfer1::, v_1_0::
MODULE = re.compile(r"\b\w*tensorrt\w*\.tensorrt\.|\btensorrt\.|\bnvinfer1::|\bnvonnxparser::|\bv_\d+_\d+::")
# C++ names pybind11 prints where a type was registered after the function using it
CPP_ALIASES = {"IParserError": "ParserError", "IBuilder": "Builder"}  # C++ names (namespace cut) -> Python
GENERIC = re.compile(r"(Optional|List|list|Sequence|Iterable|Union|Callable|dict|Dict|set|tuple|Tuple)\[(.*)\]")
ANY = {"object", "Any", "capsule", "CapsuleType", "handle"}


class NotSimulated(NotImplementedError):
    """The real class has this member, but the simulation (tests/trt_fake.py) does not implement it."""


# -- signatures, from the real __doc__ ---------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    annot: str | None
    default: bool
    kind: str  # "pos" (positional only: pybind11's argN), "any", "kw" (after `*`), "args", "kwargs"


@dataclass(frozen=True)
class Sig:
    params: tuple[Param, ...]  # without self
    ret: str
    optional_ret: bool  # the docs say the call may return None
    text: str


def _split(s: str, sep: str = ",") -> list[str]:
    """Split at top-level `sep` (outside brackets, <...> default reprs and quotes)."""
    out, depth, cur, quote = [], 0, [], None
    for ch in s:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _param(text: str, kw_only: bool) -> Param:
    if text.startswith("**"):
        return Param(text[2:].split(":")[0], None, True, "kwargs")
    if text.startswith("*"):
        return Param(text[1:].split(":")[0], None, True, "args")
    head, _, default = text.partition(" = ")
    name, _, annot = head.partition(": ")
    kind = "kw" if kw_only else ("pos" if re.fullmatch(r"arg\d+", name) else "any")
    return Param(name, annot or None, bool(default), kind)


def parse_signature(line: str, desc: str, has_self: bool) -> Sig:
    m = re.fullmatch(r"\s*(?:\w+)?\((.*)\)\s*->\s*(.+?)\s*", line)
    if m is None:
        raise ValueError(f"not a pybind11 signature: {line!r}")
    params, kw_only = [], False
    for i, p in enumerate(_split(m.group(1))):
        if p == "*":
            kw_only = True
        elif p == "/":
            params = [Param(q.name, q.annot, q.default, "pos") for q in params]
        elif not (i == 0 and has_self):
            params.append(_param(p, kw_only))
    returns = " ".join(line for line in desc.splitlines() if ":returns:" in line or "return" in line.lower())
    ret = m.group(2)
    return Sig(tuple(params), ret, ret != "None" and re.search(r"\bNone\b", returns) is not None, line.strip())


def signatures(doc: str | None, has_self: bool = True) -> list[Sig]:
    """Every overload in a pybind11 docstring."""
    if not doc:
        return []
    lines = doc.strip("\n").splitlines()
    if len(lines) > 1 and lines[1].strip() == "Overloaded function.":
        sigs, heads = [], [i for i, line in enumerate(lines) if re.match(r"^\d+\. \w*\(", line)]
        for j, i in enumerate(heads):
            end = heads[j + 1] if j + 1 < len(heads) else len(lines)
            sigs.append(parse_signature(lines[i].split(". ", 1)[1], "\n".join(lines[i + 1:end]), has_self))
        return sigs
    return [parse_signature(lines[0], "\n".join(lines[1:]), has_self)]


def member_signatures(cls, name: str) -> list[Sig]:
    """The overloads of a real method (or function, for a module), or of a property's getter."""
    attr = cls.__dict__.get(name) if isinstance(cls, type) else None
    if attr is None and isinstance(cls, type):
        for base in cls.__mro__:
            attr = base.__dict__.get(name, attr) if attr is None else attr
    if isinstance(attr, property):  # the getter's (or a write-only property's setter's)
        return signatures((attr.fget or attr.fset).__doc__)
    obj = getattr(cls, name)
    if name == "__init__" and (obj.__doc__ or "").startswith("Initialize self"):
        return []  # no constructor (pybind11's "No constructor defined!"): only the library creates these
    return signatures(obj.__doc__, has_self=isinstance(cls, type))


# -- types: pybind11's conversions -------------------------------------------------------


def norm(annot: str) -> str:
    a = MODULE.sub("", annot.strip())
    for p in PREFIXES:
        a = a.replace(p, "")
    return CPP_ALIASES.get(a, a)


def resolve(annot: str, trt):
    """The real class an annotation names (nested ones too: `ILogger.Severity`), or None."""
    obj = trt
    for part in norm(annot).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, type) else None


def known(annot: str, trt) -> bool:
    """Whether `accepts` understands this annotation (the conformance test wants all of them)."""
    a = norm(annot)
    m = GENERIC.fullmatch(a)
    if m:
        return m.group(1) == "Callable" or all(known(x, trt) for x in _split(m.group(2)))
    if "|" in a:
        return all(known(x, trt) for x in _split(a, "|"))
    return a in ANY or a in _SCALARS or a in ("None", "Buffer", "buffer", "numpy.ndarray", "os.PathLike", "Callable", "function") \
        or resolve(a, trt) is not None


def _is_int(v) -> bool:
    return not isinstance(v, float) and (isinstance(v, int) or hasattr(type(v), "__index__"))


_SCALARS = {
    "int": _is_int, "SupportsInt": _is_int,
    "float": lambda v: isinstance(v, (int, float)) or hasattr(type(v), "__float__") and not isinstance(v, str),
    "SupportsFloat": lambda v: isinstance(v, (int, float)),
    "str": lambda v: isinstance(v, (str, bytes)),
    "bytes": lambda v: isinstance(v, (bytes, bytearray)),
    # pybind11's bool takes True/False, and in its converting pass None and anything with nb_bool
    "bool": lambda v: v is None or isinstance(v, (bool, int, float)) or type(v).__name__ == "bool_",
    "slice": lambda v: isinstance(v, slice), "tuple": lambda v: isinstance(v, tuple),
    "list": lambda v: isinstance(v, list), "dict": lambda v: isinstance(v, dict),
}


# what the real bindings return for these (pybind11 casts to exactly these Python types)
_RETURNED = {"int": lambda v: type(v) is int, "SupportsInt": lambda v: type(v) is int, "bool": lambda v: type(v) is bool,
             "float": lambda v: type(v) is float, "SupportsFloat": lambda v: type(v) is float,
             "str": lambda v: type(v) is str}


def _buffer(v) -> bool:
    try:
        memoryview(v)
        return True
    except TypeError:
        return False


def accepts(annot: str, v, trt, returned: bool = False) -> bool:
    """Would pybind11 convert `v` to this parameter type (`returned`: is `v` what the real call returns)?"""
    a = norm(annot)
    m = GENERIC.fullmatch(a)
    if m:
        kind, inner = m.group(1), _split(m.group(2))
        if kind == "Optional":
            return v is None or accepts(inner[0], v, trt, returned)
        if kind == "Union":
            return any(accepts(x, v, trt, returned) for x in inner)
        if kind == "Callable":
            return callable(v)
        if kind in ("tuple", "Tuple"):
            return isinstance(v, tuple) and len(v) == len(inner) \
                and all(accepts(t, x, trt, returned) for t, x in zip(inner, v))
        if kind in ("dict", "Dict"):
            return isinstance(v, dict) and all(accepts(inner[0], k, trt, returned) and accepts(inner[1], x, trt, returned)
                                               for k, x in v.items())
        if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
            return False
        return all(accepts(inner[0], x, trt, returned) for x in v)
    if "|" in a:
        return any(accepts(x, v, trt, returned) for x in _split(a, "|"))
    if a in ANY:
        return True
    if returned and a in _RETURNED:
        return _RETURNED[a](v)
    if a in _SCALARS:
        return _SCALARS[a](v)
    if a == "None":
        return v is None
    if a in ("Buffer", "buffer"):
        return _buffer(v)
    if a == "numpy.ndarray":
        return type(v).__name__ == "ndarray"
    if a in ("os.PathLike", "Callable", "function"):
        return isinstance(v, str) or hasattr(v, "__fspath__") if a == "os.PathLike" else callable(v)
    cls = resolve(a, trt)
    if cls is None:
        raise TypeError(f"the double cannot check values of type {annot!r}")
    if isinstance(v, cls):
        return True
    # pybind11 implicit conversions the bindings register: a sequence of ints is a Dims
    if issubclass(cls, trt.Dims) and isinstance(v, (tuple, list)):
        return all(_is_int(x) for x in v)
    return False


def bind(sig: Sig, args: tuple, kwargs: dict, trt) -> str | None:
    """None if the call matches this overload, else why not."""
    pos = [p for p in sig.params if p.kind in ("pos", "any")]
    star = any(p.kind == "args" for p in sig.params)
    if len(args) > len(pos) and not star:
        return f"takes {len(pos)} positional arguments, got {len(args)}"
    given = {}
    for p, v in zip(pos, args):
        given[p.name] = v
    by_name = {p.name: p for p in sig.params if p.kind in ("any", "kw")}
    for k, v in kwargs.items():
        if k not in by_name:
            if any(p.kind == "kwargs" for p in sig.params):
                continue
            return f"no keyword argument {k!r}"
        if k in given:
            return f"{k!r} given twice"
        given[k] = v
    for p in sig.params:
        if p.kind in ("args", "kwargs"):
            continue
        if p.name not in given:
            if not p.default:
                return f"missing argument {p.name!r}"
            continue
        if p.annot and not accepts(p.annot, given[p.name], trt):
            return f"argument {p.name!r} gets {type(given[p.name]).__name__} {given[p.name]!r}, not {norm(p.annot)}"
    return None


def check_call(owner, name: str, args: tuple, kwargs: dict, trt) -> Sig:
    """The overload this call matches; TypeError (as pybind11 raises) if none does."""
    sigs = member_signatures(owner, name)
    if not sigs:
        raise NotSimulated(f"{getattr(owner, '__name__', owner)}.{name} has no pybind11 signature to check against")
    why = [bind(s, args, kwargs, trt) for s in sigs]
    for s, w in zip(sigs, why):
        if w is None:
            return s
    listed = "\n".join(f"    {i}. {s.text}: {w}" for i, (s, w) in enumerate(zip(sigs, why), 1))
    raise TypeError(f"{name}(): incompatible function arguments. The following argument types are supported:\n{listed}")


# -- proxies ---------------------------------------------------------------------------


def is_value_type(cls, trt) -> bool:
    """Real classes whose instances the simulation hands out as real objects (enums, Dims)."""
    return hasattr(cls, "__members__") or issubclass(cls, trt.Dims)


def check_return(owner, name: str, sig: Sig, value, trt):
    """Check a simulated return value against the real annotation; wrap library objects."""
    a = norm(sig.ret)
    if value is None and (sig.optional_ret or a == "None"):
        return None
    cls = resolve(a, trt)
    if cls is not None and value is not None and not is_value_type(cls, trt) \
            and not isinstance(value, Checked | HostMemory):
        # a library object: the simulation of exactly that class (a plan: bytes), wrapped
        if type(value).__name__ == f"Sim{cls.__name__}" or (cls.__name__ == "IHostMemory" and isinstance(value, bytes)):
            return wrap(cls, value, trt)
    elif accepts(a, value, trt, returned=True):
        return value
    raise TypeError(f"the simulation of {owner.__name__}.{name} returned {value!r}, "
                    f"but the real one returns {sig.ret}" + (" or None" if sig.optional_ret else ""))


def wrap(cls, sim, trt):
    return HostMemory(sim, trt) if cls.__name__ == "IHostMemory" else Checked(cls, sim, trt)


def _property(cls, name):
    for base in cls.__mro__:
        if name in base.__dict__:
            attr = base.__dict__[name]
            return attr if isinstance(attr, property) else None
    return None


def _get(real, sim, trt, proxy, name):
    if name.startswith("__") or not hasattr(real, name):
        raise AttributeError(f"'{real.__name__}' object has no attribute '{name}'")
    attr = getattr(real, name)
    prop = _property(real, name)
    if prop is not None:
        if prop.fget is None:
            raise AttributeError(f"property '{name}' of '{real.__name__}' object has no getter")
        if not hasattr(type(sim), name) and name not in getattr(sim, "__dict__", {}):
            raise NotSimulated(f"{real.__name__}.{name} (a real property) is not simulated")
        value = getattr(sim, name)
        (sig,) = signatures(prop.fget.__doc__)
        cls = resolve(sig.ret, trt)
        if cls is not None and not is_value_type(cls, trt):  # a pointer property never set reads None
            sig = replace(sig, optional_ret=True)
        return check_return(real, name, sig, value, trt)
    if isinstance(attr, type) or not callable(attr):
        return attr  # nested enums and constants: the real ones
    if isinstance(attr, types.FunctionType):  # a Python-level helper of the real package: run it as is
        return types.MethodType(attr, proxy)

    def method(*args, **kwargs):
        sig = check_call(real, name, args, kwargs, trt)
        impl = getattr(sim, name, None)
        if impl is None:
            raise NotSimulated(f"{real.__name__}.{name} is real but not simulated (tests/trt_fake.py)")
        return check_return(real, name, sig, impl(*args, **kwargs), trt)

    method.__name__ = name
    return method


def _set(real, sim, trt, name, value):
    prop = _property(real, name)
    if prop is None:
        raise AttributeError(f"'{real.__name__}' object has no attribute '{name}'" if not hasattr(real, name)
                             else f"'{real.__name__}' object attribute '{name}' is not a property")
    if prop.fset is None:
        raise AttributeError(f"property '{name}' of '{real.__name__}' object has no setter")
    (sig,) = signatures(prop.fset.__doc__)
    annot = sig.params[0].annot
    if not accepts(annot, value, trt):
        raise TypeError(f"(): incompatible function arguments: {real.__name__}.{name} takes {norm(annot)}, "
                        f"got {type(value).__name__} {value!r}")
    setattr(sim, name, value)


class Checked:
    """A library object: the real class's interface, checked; the simulation's behaviour."""

    __slots__ = ("_real", "_sim", "_trt")

    def __init__(self, real: type, sim, trt):
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_sim", sim)
        object.__setattr__(self, "_trt", trt)

    @property
    def __class__(self):  # isinstance(proxy, trt.ICudaEngine) holds, as for the real object
        return object.__getattribute__(self, "_real")

    def __getattr__(self, name):
        return _get(self._real, self._sim, self._trt, self, name)

    def __setattr__(self, name, value):
        _set(self._real, self._sim, self._trt, name, value)

    def _dunder(self, name, *args):
        if not hasattr(self._real, name):
            raise TypeError(f"'{self._real.__name__}' object does not support {name}")
        sig = check_call(self._real, name, args, {}, self._trt)
        impl = getattr(self._sim, name, None)
        if impl is None:
            raise NotSimulated(f"{self._real.__name__}.{name} is real but not simulated")
        return check_return(self._real, name, sig, impl(*args), self._trt)

    def __len__(self):
        return self._dunder("__len__")

    def __getitem__(self, i):
        return self._dunder("__getitem__", i)

    def __iter__(self):
        if not hasattr(self._real, "__getitem__"):
            raise TypeError(f"'{self._real.__name__}' object is not iterable")
        i = 0
        while True:
            try:
                yield self[i]
            except IndexError:
                return
            i += 1

    def __bool__(self):
        if hasattr(self._real, "__bool__"):
            return self._dunder("__bool__")
        return self._dunder("__len__") > 0 if hasattr(self._real, "__len__") else True

    def __enter__(self):  # the real package's own Python helpers (deprecated; they warn, as on TensorRT)
        if not hasattr(self._real, "__enter__"):
            raise TypeError(f"'{self._real.__name__}' object does not support the context manager protocol")
        return self._real.__enter__(self)

    def __exit__(self, *exc):
        return self._real.__exit__(self, *exc)

    def __str__(self):
        if "__str__" in self._real.__dict__:
            return self._dunder("__str__")
        return repr(self)

    def __repr__(self):
        return f"<double of {self._real.__module__}.{self._real.__name__}>"


class HostMemory(bytes):
    """IHostMemory: a buffer (as the real one) whose attributes are checked against the real class."""

    def __new__(cls, data, trt):
        self = super().__new__(cls, bytes(data))
        self._trt = trt
        return self

    def __getattribute__(self, name):
        if name.startswith("__") or name == "_trt":
            return super().__getattribute__(name)
        real = super().__getattribute__("_trt").IHostMemory
        if name == "nbytes":
            return len(self)
        return _get(real, self, super().__getattribute__("_trt"), self, name)

    @property
    def __class__(self):
        return super().__getattribute__("_trt").IHostMemory

    def __enter__(self):
        return super().__getattribute__("_trt").IHostMemory.__enter__(self)  # the real helper (it warns, as on TensorRT)

    def __exit__(self, *exc):
        return super().__getattribute__("_trt").IHostMemory.__exit__(self, *exc)


# -- the module ------------------------------------------------------------------------


def factory(trt, real: type, sim_cls):
    """trt.Builder / trt.Runtime / trt.OnnxParser: the real constructor's signature, a simulated object."""

    def make(*args, **kwargs):
        check_call(real, "__init__", args, kwargs, trt)
        return Checked(real, sim_cls(trt, *args, **kwargs), trt)

    make.__name__ = make.__qualname__ = real.__name__
    make.__doc__ = real.__doc__
    make.real = real
    return make


def module_function(trt, name: str, impl):
    """A module-level function with the real one's signature and a simulated body."""

    def call(*args, **kwargs):
        sig = check_call(trt, name, args, kwargs, trt)
        return check_return(types.SimpleNamespace(__name__="tensorrt"), name, sig, impl(*args, **kwargs), trt)

    call.__name__ = name
    return call


@lru_cache(maxsize=None)
def double(version: str) -> types.ModuleType:
    """The double of TensorRT `version`: the real module, with the library's factories simulated."""
    import trt_bindings
    import trt_fake

    real = trt_bindings.load(version)
    mod = types.ModuleType("tensorrt", f"Test double of TensorRT {version} (tests/trt_double.py)")
    mod.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("__") or k == "__version__"})
    mod.__real__ = real
    mod.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)  # importlib.util.find_spec("tensorrt") works, as installed
    for name, sim in trt_fake.FACTORIES.items():
        setattr(mod, name, factory(real, getattr(real, name), sim))
    for name, impl in trt_fake.FUNCTIONS.items():
        setattr(mod, name, module_function(real, name, impl))
    return mod


def forget_polygraphy_tensorrt(monkeypatch) -> None:
    """Polygraphy imports `tensorrt` lazily once per process and keeps a logger subclassing its
    ILogger: let it import the double installed now (tests switch TensorRT versions)."""
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("polygraphy") or module is None:
            continue
        for value in list(vars(module).values()):
            if type(value).__name__ == "LazyModule" and getattr(value.__dict__.get("module"), "__name__", None) == "tensorrt":
                object.__setattr__(value, "module", None)
    if "polygraphy.backend.trt.util" in sys.modules:
        monkeypatch.setattr(sys.modules["polygraphy.backend.trt.util"], "TRT_LOGGER", None)
