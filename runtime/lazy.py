"""The one declared way to import what pulls in an optional dependency (as Polygraphy's
`mod.lazy_import`): `torch = lazy_import("torch")` at the top of a file costs nothing until
the first attribute is read, so a command imports only what it runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import types

from .errors import DFlashError

EXTRAS = {"torch": "export", "onnx": "export", "onnxscript": "export", "huggingface_hub": "export", "onnxruntime": "cpu", "tensorrt": "trt",
          "fastapi": "serve", "uvicorn": "serve", "ray": "ray", "matplotlib": "dev"}  # optional dependency -> the extra installing it
# our modules that import them (serve's engine and text import none: they are the torch-free half; train's config
# neither: the CLI builds train-draft's options from it)
HEAVY = ("dflash_export.export", "dflash_export.models", "dflash_export.train.train", "dflash_export.train.data",
         "dflash_export.train.cache", "dflash_export.train.eval", "dflash_export.train.forward", "dflash_export.train.loss",
         "dflash_export.train.speed", "dflash_export.train.state", "dflash_export.serve.app",
         "dflash_export.serve.requests", "dflash_export.serve.tools", "dflash_export.serve.respond", "dflash_export.serve.validate",
         "dflash_export.serve.ray", "dflash_export.runtime.ort.backend", "dflash_export.runtime.ort.sessions",
         "dflash_export.runtime.trt.backend")
# ... but for these, which the CLI reads before anything loads: they name their optional dependencies with lazy_import
LIGHT = ("dflash_export.export.sources", "dflash_export.export.quant_options", "dflash_export.export.options")


class LazyModule(types.ModuleType):
    """Stands for module `name` and imports it on the first attribute read."""

    def __getattr__(self, attr: str):
        try:
            module = importlib.import_module(self.__name__)
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if top in EXTRAS:
                raise DFlashError(f"{self.__name__} needs {top}, which is not installed: pip install "
                                  f"\"dflash-export[{EXTRAS[top]}]\"") from None
            raise
        return getattr(module, attr)


def lazy_import(name: str) -> types.ModuleType:
    """A stand-in for `import name` that imports on first use (an absolute module name)."""
    return LazyModule(name)


def installed(name: str) -> bool:
    """Whether module `name` can be imported, found without importing it (its parent packages aside)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ValueError, ImportError):  # e.g. sys.modules[name] is None, or a parent package is missing
        return False
