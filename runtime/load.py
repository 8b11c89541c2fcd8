"""Opening an exported directory: the backend by name, with its settings resolved.

`open_artifact` is the one way `generate`, `bench`, `demo`, `serve` and Ray open a directory:
the backend (ONNX Runtime or TensorRT, imported only when asked for) with the run's settings,
the run's options (runtime/settings.py RunOptions) over runtime.json over the defaults.
"""

from __future__ import annotations

from pathlib import Path

from .backend import Backend
from .errors import DFlashError
from .lazy import lazy_import
from .manifest import load_manifest
from .settings import RunOptions, Settings, resolve


def open_artifact(directory: str | Path, run: RunOptions | None = None, *, drafter: bool = True, max_batch: int = 1,
                  settings: Settings | None = None) -> tuple[Backend, Settings]:
    """(backend, settings) over `directory` run as `run` says (None: the defaults); the settings
    carry the verify policy the loop takes (`settings`: resolved already, by `settings_for`).
    `max_batch`: rows decoded together (ONNX Runtime's CPU provider, or TensorRT engines built
    with `--max-batch`; docs/batching.md)."""
    run = run or RunOptions()
    if run.backend == "ort":
        ort_backend_class()  # the install hint comes before anything about the directory
    cfg = settings or settings_for(directory, run)
    kwargs = {"drafter": drafter, "max_batch": max_batch} | (cfg.ort_kwargs() if run.backend == "ort" else {})
    return open_backend(directory, run.backend, run.provider, **kwargs), cfg


def settings_for(directory: str | Path, run: RunOptions | None = None) -> Settings:
    """The run's settings alone (the backend verifies the hashes when it loads)."""
    return resolve(directory, load_manifest(directory, verify=False), run or RunOptions())


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
