"""The TensorRT names and calls of the project, and the test double, against the REAL bindings.

For TensorRT 10.12.0.36 and 11.4.0.106 (tests/trt_bindings.py):
- every `tensorrt` name the package uses resolves (an AST walk over the installed package's
  sources, not a list kept by hand); a name under a TensorRT version check only in the
  versions the check admits;
- every member the simulation offers exists on the real class with the same parameters;
- the double's argument checks agree with pybind11 itself on real callables;
- the double refuses deliberately wrong calls (removed flags, wrong arity, types, keywords,
  read-only properties, unknown members, wrong simulated return types): it can fail.
"""

import ast
import inspect
import tomllib
import types
from pathlib import Path

import numpy as np
import pytest
from runtime_cases import ROOT, TRT_CASES, artifact

import trt_bindings
import trt_double as D
import trt_fake
from dflash_export.runtime.trt.engines import trt_version_tuple

VERSIONS = trt_bindings.VERSIONS


@pytest.fixture(scope="module", params=VERSIONS)
def real(request):
    return trt_bindings.require(request.param)


# -- the project's TensorRT names ---------------------------------------------------------


def package_sources() -> list[Path]:
    """The installed packages' own files (pyproject's list; the package is the top level, its
    sub-packages are folders), not the tests, benchmarks or a venv under the same root."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return sorted(p for pkg in packages for p in ROOT.joinpath(*pkg.split(".")[1:]).glob("*.py"))


def _chain(node) -> list[str] | None:
    """['Logger', 'WARNING'] for trt.Logger.WARNING or self.trt.Logger.WARNING; None if not rooted at trt."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
        if isinstance(node, ast.Attribute) and node.attr == "trt" and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            return names[::-1]
    return names[::-1] if isinstance(node, ast.Name) and node.id == "trt" and names else None


def _admits(test: ast.expr, version: str) -> bool | None:
    """The value of an `if` test for a TensorRT version, or None if it is not a version check."""
    if "__version__" not in ast.unparse(test):
        return None
    try:
        env = {"trt": types.SimpleNamespace(__version__=version), "trt_version_tuple": trt_version_tuple}
        return bool(eval(compile(ast.Expression(test), "<test>", "eval"), env))  # noqa: S307 - our own source
    except Exception:  # noqa: BLE001 - not a check we can evaluate: the names must resolve everywhere
        return None


def tensorrt_names(version: str) -> list[tuple[str, int, str]]:
    """(file, line, 'A.B') of every tensorrt name the package uses that `version` must have."""
    found = []

    def visit(node, path, admitted):
        if isinstance(node, (ast.If, ast.IfExp)):
            ok = _admits(node.test, version)
            visit(node.test, path, admitted)
            for child in (node.body if isinstance(node.body, list) else [node.body]):
                visit(child, path, admitted and ok is not False)
            for child in (node.orelse if isinstance(node.orelse, list) else [node.orelse]):
                visit(child, path, admitted and ok is not True)
            return
        if isinstance(node, ast.Attribute) and (chain := _chain(node)) is not None:
            if admitted:
                found.append((path.relative_to(ROOT).as_posix(), node.lineno, ".".join(chain)))
            return
        for child in ast.iter_child_nodes(node):
            visit(child, path, admitted)

    for path in package_sources():
        visit(ast.parse(path.read_text()), path, True)
    return found


def test_every_tensorrt_name_the_package_uses_resolves(real):
    used = tensorrt_names(real.__version__)
    files = {f for f, _, _ in used}
    assert {"runtime/trt/backend.py", "export/trt_build.py"} <= files, files  # the walk sees the TensorRT code
    assert len(used) >= 15, used
    unresolved = []
    for f, line, chain in used:
        obj = real
        for part in chain.split("."):
            if not hasattr(obj, part):
                unresolved.append(f"{f}:{line} trt.{chain}")
                break
            obj = getattr(obj, part)
    assert unresolved == [], f"TensorRT {real.__version__} lacks: {unresolved}"
    print(f"TensorRT {real.__version__}: {len(used)} uses of {len({c for *_, c in used})} names resolve")


def test_version_checks_select_the_names(tmp_path):
    """The walk follows TensorRT version checks: a name under `< (11, 0)` must exist on 10.x only."""
    tree = ast.parse("if trt_version_tuple(trt.__version__) < (11, 0):\n    x = trt.BuilderFlag.FP16\n"
                     "else:\n    x = trt.BuilderFlag.TF32\n")
    assert _admits(tree.body[0].test, "10.12.0.36") is True and _admits(tree.body[0].test, "11.4.0.106") is False
    assert _admits(ast.parse("a < b").body[0].value, "11.4.0.106") is None


# -- the double's members against the real ones -------------------------------------------


def _sim_classes():
    return {name[3:]: cls for name, cls in vars(trt_fake).items() if name.startswith("Sim") and isinstance(cls, type)}


def _params(fn, skip: int) -> list[str]:
    return [p.name for p in list(inspect.signature(fn).parameters.values())[skip:]]


def _matches(fn, sig, skip: int = 1) -> bool:
    """The simulation's parameters are the real overload's, in order (trailing real ones with defaults may be left out:
    a call that passes them then fails in the simulation, loudly)."""
    mine = _params(fn, skip)
    return [p.name for p in sig.params[:len(mine)]] == mine and all(p.default for p in sig.params[len(mine):])


def test_every_simulated_member_exists_with_the_real_signature(real):
    checked = 0
    for real_name, cls in _sim_classes().items():
        R = getattr(real, real_name)
        for name, member in vars(cls).items():
            if name.startswith("_") and name not in ("__len__", "__getitem__", "__bool__", "__str__"):
                continue
            if not hasattr(R, name):  # a member of another pinned version only (the double refuses it here)
                others = [trt_bindings.load(v) for v in VERSIONS if v != real.__version__]
                assert any(hasattr(getattr(o, real_name), name) for o in others), f"no TensorRT has {real_name}.{name}"
                continue
            if isinstance(member, property):
                assert isinstance(D._property(R, name), property), f"{real_name}.{name} is not a property on the real class"
            elif callable(member) and name != "__str__":
                sigs = D.member_signatures(R, name)
                assert any(_matches(member, s) for s in sigs), \
                    f"{real_name}.{name}{_params(member, 1)} vs real {[s.text for s in sigs]}"
            checked += 1
    for name, sim_cls in trt_fake.FACTORIES.items():  # constructors: (trt, *the real parameters)
        assert any(_matches(sim_cls.__init__, s, 2) for s in D.member_signatures(getattr(real, name), "__init__")), name
    for name, impl in trt_fake.FUNCTIONS.items():
        assert any(_matches(impl, s, 0) for s in D.member_signatures(real, name)), name
    assert checked >= 40, checked


def test_our_progress_monitor_overrides_real_methods(real, monkeypatch):
    """export/trt_build.py subclasses the real IProgressMonitor: its overrides must be real members."""
    from dflash_export.export.trt_build import _progress_monitor

    monitor = _progress_monitor(real, None)
    assert isinstance(monitor, real.IProgressMonitor)
    for name in ("phase_start", "step_complete", "phase_finish"):
        (sig,) = D.member_signatures(real.IProgressMonitor, name)
        assert _params(getattr(type(monitor), name), 1) == [p.name for p in sig.params], name


def test_signatures_parse_and_every_type_is_understood(real):
    """Every member of the classes the double stands for has a parsed signature whose types the checker knows."""
    members = overloaded = 0
    for real_name in [*_sim_classes(), "Logger", "ILogger", "IProgressMonitor"]:
        R = getattr(real, real_name)
        for name in dir(R):
            attr = getattr(R, name)
            if name.startswith("_") and name not in ("__init__", "__len__", "__getitem__", "__bool__"):
                continue
            if isinstance(attr, type) or not (callable(attr) or D._property(R, name)) \
                    or isinstance(attr, types.FunctionType):
                continue
            sigs = D.member_signatures(R, name)
            if name == "__init__" and not sigs:
                continue  # no constructor: only the library creates these
            assert sigs, f"{real_name}.{name}: no signature parsed"
            members += 1
            overloaded += len(sigs) > 1
            for s in sigs:
                for annot in [p.annot for p in s.params if p.annot] + [s.ret]:
                    assert D.known(annot, real), f"{real_name}.{name}: cannot check type {annot!r}"
    assert members > 200 and overloaded >= 10, (members, overloaded)
    (sig,) = [s for s in D.member_signatures(real.Runtime, "deserialize_cuda_engine") if "serialized_engine" in s.text]
    assert sig.optional_ret  # "returns: The ICudaEngine, or None if it could not be deserialized" (annotation omits None)
    assert not D.member_signatures(real.IExecutionContext, "set_input_shape")[0].optional_ret
    print(f"TensorRT {real.__version__}: {members} members, {overloaded} overloaded, every type understood")


def _pybind_accepts(fn) -> bool:
    try:
        fn()
        return True
    except TypeError:
        return False


def test_argument_checks_agree_with_pybind11(real):
    """On real callables that need no library: the double accepts exactly what pybind11 accepts."""
    dims = real.Dims((1, 2, 3))
    for arg in (1, True, np.int64(1), 1.0, "1", real.DataType.HALF):
        want = _pybind_accepts(lambda: dims[arg])
        got = any(D.bind(s, (arg,), {}, real) is None for s in D.member_signatures(real.Dims, "__getitem__"))
        assert got == want, (arg, got, want)
    for args, kwargs in [((real.Logger.ERROR,), {}), ((2,), {}), ((), {"min_severity": real.Logger.INFO}),
                         ((), {"severity": real.Logger.INFO}), ((real.Logger.ERROR, 1), {})]:
        want = _pybind_accepts(lambda: real.Logger(*args, **kwargs))
        got = any(D.bind(s, args, kwargs, real) is None for s in D.member_signatures(real.Logger, "__init__"))
        assert got == want, (args, kwargs, got, want)
    for shape in [(1, 2), [3], [1.5], ("a",), np.array([1, 2])]:
        want = _pybind_accepts(lambda: real.Dims(shape))
        got = any(D.bind(s, (shape,), {}, real) is None for s in D.member_signatures(real.Dims, "__init__"))
        assert got == want, (shape, got, want)


# -- deliberately wrong calls --------------------------------------------------------------


@pytest.fixture
def objs(real, monkeypatch):
    """Library objects of the double: builder, network (parsed), config, profile, engine, context."""
    trt = trt_fake.install(monkeypatch, real.__version__)
    out = artifact(TRT_CASES["fp32-k4"])[2]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(out / "draft_context.onnx")) and network.num_inputs == 2
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        lo = [1 if d == -1 else d for d in t.shape]
        profile.set_shape(t.name, lo, lo, [4 if d == -1 else d for d in t.shape])
    config.add_optimization_profile(profile)
    config.set_timing_cache(config.create_timing_cache(b""), False)
    plan = builder.build_serialized_network(network, config)
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    return types.SimpleNamespace(trt=trt, builder=builder, network=network, config=config, profile=profile,
                                 engine=engine, ctx=engine.create_execution_context(), plan=plan)


def test_objects_are_the_real_classes(objs):
    trt = objs.trt
    assert isinstance(objs.engine, trt.ICudaEngine) and isinstance(objs.ctx, trt.IExecutionContext)
    assert isinstance(objs.plan, trt.IHostMemory) and bytes(objs.plan)  # a buffer, as the real IHostMemory
    assert trt.DataType is trt.__real__.DataType and trt.Dims is trt.__real__.Dims  # NVIDIA's own objects
    assert objs.engine.get_tensor_dtype("taps") == trt.float32 and isinstance(objs.network.get_input(0).shape, trt.Dims)
    assert objs.engine.get_tensor_mode("taps") == trt.TensorIOMode.INPUT
    assert [tuple(d) for d in objs.engine.get_tensor_profile_shape("taps", 0)][0][:2] == (1, 1)


WRONG = {  # what a mistake in our code would look like -> the exception the real bindings raise
    "enum where an int is wanted: set_flag(6)": (lambda o: o.config.set_flag(6), TypeError),
    "wrong arity: set_input_shape(name)": (lambda o: o.ctx.set_input_shape("taps"), TypeError),
    "float address: set_tensor_address(name, 1.5)": (lambda o: o.ctx.set_tensor_address("taps", 1.5), TypeError),
    "no stream: execute_async_v3()": (lambda o: o.ctx.execute_async_v3(), TypeError),
    "wrong keyword: create_network(flag=0)": (lambda o: o.builder.create_network(flag=0), TypeError),
    "float in a shape: set_shape(..., (1, 2.5))": (lambda o: o.profile.set_shape("taps", (1, 1, 2), (1, 2.5, 2), (1, 4, 2)),
                                                   TypeError),
    "string size: set_memory_pool_limit(WORKSPACE, '4GB')":
        (lambda o: o.config.set_memory_pool_limit(o.trt.MemoryPoolType.WORKSPACE, "4GB"), TypeError),
    "path instead of bytes: deserialize_cuda_engine(str)":
        (lambda o: o.trt.Runtime(o.trt.Logger()).deserialize_cuda_engine("engines/target.engine"), TypeError),
    "int severity: Runtime(2)": (lambda o: o.trt.Runtime(2), TypeError),
    "read-only property: num_io_tensors = 3": (lambda o: setattr(o.engine, "num_io_tensors", 3), AttributeError),
    "wrong type to a property: progress_monitor = 'bars'": (lambda o: setattr(o.config, "progress_monitor", "bars"),
                                                            TypeError),
    "removed in 10.0: get_binding_index": (lambda o: o.engine.get_binding_index("taps"), AttributeError),
    "removed in 10.0: execute_async_v2": (lambda o: o.ctx.execute_async_v2([], 0), AttributeError),
    "removed in 10.0: max_batch_size": (lambda o: o.engine.max_batch_size, AttributeError),
    "never existed: engine.get_tensor_location_name": (lambda o: o.engine.get_tensor_location_name("taps"),
                                                       AttributeError),
}
REMOVED_IN_11 = {  # exist on 10.12, gone on 11.4 (weak typing, implicit batch)
    "BuilderFlag.FP16": lambda o: o.config.set_flag(o.trt.BuilderFlag.FP16),
    "BuilderFlag.OBEY_PRECISION_CONSTRAINTS": lambda o: o.config.set_flag(o.trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS),
    "NetworkDefinitionCreationFlag.EXPLICIT_BATCH":
        lambda o: o.builder.create_network(1 << int(o.trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)),
    "IBuilderConfig.int8_calibrator": lambda o: o.config.int8_calibrator,
}


@pytest.mark.parametrize("what", list(WRONG))
def test_wrong_calls_are_refused(objs, what):
    call, exc = WRONG[what]
    with pytest.raises(exc):
        call(objs)


@pytest.mark.parametrize("what", list(REMOVED_IN_11))
def test_names_removed_in_11_are_refused_there_only(objs, what):
    call = REMOVED_IN_11[what]
    if objs.trt.__version__.startswith("11."):
        with pytest.raises(AttributeError):
            call(objs)
    else:
        call(objs)  # 10.12 still has it


def test_simulated_returns_are_checked(objs, monkeypatch):
    """A simulation returning what the real call never returns is caught too."""
    monkeypatch.setattr(trt_fake.SimICudaEngine, "get_tensor_dtype", lambda self, name: "float32")
    with pytest.raises(TypeError, match="returns .*DataType"):
        objs.engine.get_tensor_dtype("taps")
    monkeypatch.setattr(trt_fake.SimIExecutionContext, "set_input_shape", lambda self, name, shape: None)
    with pytest.raises(TypeError, match="returns bool"):  # the docs do not say None: not allowed
        objs.ctx.set_input_shape("taps", (1, 2, 96))
    assert objs.trt.Runtime(objs.trt.Logger()).deserialize_cuda_engine(b"not a plan") is None  # documented None
    monkeypatch.setattr(trt_fake.SimICudaEngine, "create_execution_context", lambda self: None)
    with pytest.raises(TypeError, match="returns .*IExecutionContext"):  # not documented to return None
        objs.engine.create_execution_context()
    monkeypatch.setattr(trt_fake.SimINetworkDefinition, "get_input", lambda self, index: object())
    with pytest.raises(TypeError, match="returns .*ITensor"):  # not a simulation of the annotated class
        objs.network.get_input(0)
    monkeypatch.delattr(trt_fake.SimICudaEngine, "get_tensor_shape", raising=False)
    with pytest.raises(D.NotSimulated):  # real but not simulated: loud, and not an AttributeError
        objs.engine.get_tensor_shape("taps")


def test_context_managers_are_the_real_helpers(objs):
    with pytest.warns(DeprecationWarning, match="Context managers for TensorRT types are deprecated"):
        with objs.engine as e:
            assert e is objs.engine
    with pytest.raises(TypeError, match="context manager"):
        with objs.profile:  # IOptimizationProfile has none
            pass
