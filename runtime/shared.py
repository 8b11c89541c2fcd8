"""The weights several graphs share (embedding, LM head, the drafter's K/V projections), read
from shared.data where the manifest's `shared` table says they are: numpy only, so that any
backend maps them the same way (runtime/ort/sessions.py hands them to every session that holds them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import contract as C, manifest as M
from .errors import DFlashError

# TensorProto.DataType; uint8: weight-only quantized tensors (MatMulNBits, docs/quantization.md); int32: the
# ort attention flavour's lengths (contract.TARGET_ORT)
ONNX_TYPE = {"float32": 1, "float16": 10, "bfloat16": 16, "int64": 7, "uint8": 2, "int8": 3, "int32": 6}
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int64": np.int64, "uint8": np.uint8,
           "int8": np.int8, "int32": np.int32}


def shared_weights(directory: Path, m: M.Manifest) -> dict[str, tuple[np.ndarray, int]]:
    """name -> (array over its bytes in shared.data, onnx element type), one array per
    distinct (file, offset, dtype, shape): tied names share it; names over the same bytes in
    another shape (a quantized tied head and its lookup table) are views of them. Mapped
    copy-on-write: the pages are the file's (no copy at load); nothing is ever written back."""
    maps: dict[str, np.memmap] = {}
    seen: dict[tuple, np.ndarray] = {}
    out = {}
    for name, t in m.shared.items():
        path = (directory / t.file).resolve()
        if directory.resolve() not in path.parents:
            raise DFlashError(f"{directory}: shared weight {name} points outside the directory ({t.file}); re-export it")
        if t.dtype not in STORAGE:
            raise DFlashError(f"{directory}: shared weight {name} has unsupported dtype {t.dtype}; re-export it")
        mm = maps.get(t.file)
        if mm is None:
            mm = maps[t.file] = np.memmap(path, np.uint8, mode="c")
        dtype = np.dtype(STORAGE[t.dtype])
        if t.length != int(np.prod(t.shape)) * dtype.itemsize or t.offset + t.length > mm.size:
            raise DFlashError(f"{directory}: shared weight {name} does not fit {t.file}; re-export the directory")
        key = (t.file, t.offset, t.dtype, tuple(t.shape))
        if key not in seen:
            seen[key] = mm[t.offset : t.offset + t.length].view(dtype).reshape(t.shape)
        out[name] = (seen[key], ONNX_TYPE[t.dtype])
    return out


def tied_head_graphs(m: M.Manifest, shared: dict) -> set[str]:
    """Graphs whose LM head is the fp32 embedding table itself (tied, read transposed): these
    are built without ORT's constant folding (fp16 needs it: CPU MatMul casts folded to fp32)."""
    embed, head = C.SHARED_INITIALIZERS
    if m.dtype != "fp32" or head not in shared or embed not in shared or shared[head][0] is not shared[embed][0]:
        return set()
    return set(m.shared[head].graphs)
