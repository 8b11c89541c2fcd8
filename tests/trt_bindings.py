"""The real TensorRT Python bindings, importable on a machine without TensorRT or a GPU.

NVIDIA publishes the bindings alone as `tensorrt-cu12-bindings` wheels (~1.2 MB; the package
inside is `tensorrt_bindings`). Its `tensorrt.so` is a pybind11 module linked against
libnvinfer / libnvinfer_plugin / libnvonnxparser, from which it needs 9 functions at import.
Built here as stubs that return NULL (gcc, the right sonames) and placed beside it (its rpath
is $ORIGIN), they make the real module import: the enums, `Dims`, `DataType`, `Logger`, the
`ILogger`/`IProgressMonitor` bases and every member's real signature are NVIDIA's. Anything
that needs the library (`Builder(...)`, `Runtime(...)`, `OnnxParser(...)`) raises
`TypeError: ... factory function returned nullptr`: tests/trt_double.py simulates those.

The wheels live in a cache directory, not in the venv: `import tensorrt` stays what it is for
users (absent on these machines), and a test loads a version under a private module name.

    python tests/trt_bindings.py     # `make setup`: download both pinned versions, build the stubs

Under `make test` (DFLASH_REQUIRE_TRT_BINDINGS=1) a missing wheel or compiler fails the tests
that need them; elsewhere (a plain `pytest` without setup) they skip with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSIONS = ("10.12.0.36", "11.4.0.106")  # the two ends of the supported range (runtime/trt/engines.py)
PACKAGE = "tensorrt-cu12-bindings"
REQUIRED_ENV = "DFLASH_REQUIRE_TRT_BINDINGS"
# what tensorrt.so imports from each library (`nm -D --undefined-only tensorrt.so`, both versions;
# libc's dlopen/dlsym/dlclose are left alone); every stub returns NULL / 0
STUBS = {
    "libnvinfer": ["createInferBuilder_INTERNAL", "createInferRefitter_INTERNAL", "createInferRuntime_INTERNAL",
                   "getBuilderPluginRegistry", "getPluginRegistry"],
    "libnvinfer_plugin": ["initLibNvInferPlugins"],
    "libnvonnxparser": ["createNvOnnxParser_INTERNAL", "createNvOnnxParserRefitter_INTERNAL", "getNvOnnxParserVersion"],
}


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_TRT_BINDINGS_CACHE") or Path.home() / ".cache" / "dflash-export" / "trt-bindings")


def package_dir(version: str) -> Path:
    return cache_root() / version / "tensorrt_bindings"


def prepare(version: str) -> Path:
    """Download the wheel and build the stubs once (a `.ready` marker is written last); -> package dir."""
    from filelock import FileLock

    root = cache_root() / version
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if (root / ".ready").is_file():
            return root / "tensorrt_bindings"
        shutil.rmtree(root, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                            f"{PACKAGE}=={version}", "-d", tmp], check=True)
            (wheel,) = Path(tmp).glob("*.whl")
            with zipfile.ZipFile(wheel) as z:
                z.extractall(root)
            major = version.split(".")[0]
            for lib, symbols in STUBS.items():
                src = Path(tmp) / f"{lib}.c"
                src.write_text("".join(f"void *{s}(void) {{ return 0; }}\n" for s in symbols))
                so = f"{lib}.so.{major}"
                try:
                    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(root / "tensorrt_bindings" / so),
                                    f"-Wl,-soname,{so}", str(src)], check=True)
                except FileNotFoundError:
                    raise SystemExit("error: the TensorRT binding stubs need a C compiler: install gcc "
                                     "(apt-get install gcc) and run `make setup` again") from None
        (root / ".ready").write_text(version)
    return root / "tensorrt_bindings"


def missing(version: str) -> str | None:
    """Why `load(version)` cannot work here, or None."""
    if not (cache_root() / version / ".ready").is_file():
        return f"the {PACKAGE} {version} wheel and its stub libraries are not in {cache_root()}: run `make setup`"
    return None


def load(version: str):
    """The real `tensorrt` module of `version`, as the private module `_tensorrt_<version>`."""
    alias = "_tensorrt_" + version.replace(".", "_")
    if alias in sys.modules:
        return sys.modules[alias]
    pkg = package_dir(version)
    spec = importlib.util.spec_from_file_location(alias, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[alias]
        raise
    assert module.__version__ == version, (module.__version__, version)
    return module


def require(version: str):
    """load(version) for a test: skipped with the reason where it is missing, failed under `make test`."""
    import pytest

    why = missing(version)
    if why is not None:
        if os.environ.get(REQUIRED_ENV) == "1":
            pytest.fail(f"{why} ({REQUIRED_ENV}=1: `make test` needs the real bindings)")
        pytest.skip(why)
    return load(version)


if __name__ == "__main__":
    for v in VERSIONS:
        if missing(v):
            print(f"tensorrt bindings {v}: {prepare(v)}")
        load(v)  # imports here, or setup fails now rather than in the tests
