"""Opening an exported directory: the backend by name, with its settings resolved.

`open_artifact` is the one way `generate`, `bench`, `demo`, `serve` and Ray open a directory:
the backend (ONNX Runtime or TensorRT, imported only when asked for) with the run's settings,
--threads/--spin/--verify over runtime.json over the defaults (runtime/settings.py).
"""

from __future__ import annotations

from pathlib import Path

from .backend import Backend
from .errors import DFlashError
from .lazy import lazy_import
from .manifest import load_manifest
from .settings import Settings, device_key, resolve


def open_artifact(directory: str | Path, *, backend: str = "ort", provider: str = "cpu", drafter: bool = True,
                  threads: int | None = None, spin: bool | None = None, verify: str = "auto",
                  max_batch: int = 1) -> tuple[Backend, Settings]:
    """(backend, settings) over `directory`; the settings carry the verify policy the loop takes.
    `max_batch`: rows decoded together (ONNX Runtime's CPU provider, or TensorRT engines built
    with `--max-batch`; docs/batching.md)."""
    if backend == "ort":
        ort_backend_class()  # the install hint comes before anything about the directory
    cfg = settings_for(directory, backend, provider, threads=threads, spin=spin, verify=verify)
    kwargs = {"drafter": drafter, "max_batch": max_batch} | (cfg.ort_kwargs() if backend == "ort" else {})
    return open_backend(directory, backend, provider, **kwargs), cfg


def settings_for(directory: str | Path, backend: str = "ort", provider: str = "cpu", *, threads: int | None = None,
                 spin: bool | None = None, verify: str = "auto") -> Settings:
    """The run's settings alone (the backend verifies the hashes when it loads)."""
    m = load_manifest(directory, verify=False)
    return resolve(directory, m, device_key(backend, provider), threads=threads, spin=spin, verify=verify)


def open_backend(directory, backend: str = "ort", provider: str = "cpu", **kwargs) -> Backend:
    """The named backend over an exported directory: "ort" (provider cpu | cuda | tensorrt) or
    "trt" (TensorRT engines from `dflash-export build`). Each is imported only when asked for."""
    if backend == "ort":
        return ort_backend_class()(directory, provider, **kwargs)
    if backend == "trt":
        return lazy_import("dflash_export.runtime.trt.backend").TensorRTBackend(directory, **kwargs)
    raise DFlashError(f"unknown backend {backend!r}; choose ort or trt")


def ort_backend_class():
    """OrtBackend, or a one-line install hint when onnxruntime is missing."""
    try:
        from .ort.backend import OrtBackend
    except ModuleNotFoundError as e:
        if e.name != "onnxruntime":
            raise
        raise DFlashError(
            'ONNX Runtime is not installed: pip install "dflash-export[cpu]" (or "dflash-export[gpu]" '
            "for CUDA; the two are alternatives, never install both)"
        ) from None
    return OrtBackend
