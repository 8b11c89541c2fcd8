"""Reading and writing safetensors checkpoints, strictly: every tensor accounted for."""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
from pathlib import Path

import torch
from torch import nn

from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import

safetensors_torch = lazy_import("safetensors.torch")  # on first use (runtime/lazy.py)
safetensors = lazy_import("safetensors")

# tensors that load_state_dict returns on the meta device (shape and dtype only, nothing read):
# export streams them from the checkpoint as it writes them (export/stream.py)
_ON_META: contextvars.ContextVar = contextvars.ContextVar("on_meta", default=None)
EXPERTS = re.compile(r"(?:^|\.)layers\.\d+\.mlp\.experts\.")  # routed experts, either layout


@contextlib.contextmanager
def experts_on_meta(pattern: re.Pattern = EXPERTS):
    """Within: load_state_dict reads no tensor whose name matches `pattern`; it returns a meta
    tensor of its shape and dtype instead, so a 30B-class target's experts never sit in memory
    while its graph is traced (export writes them straight from the checkpoint)."""
    token = _ON_META.set(pattern)
    try:
        yield
    finally:
        _ON_META.reset(token)


def weight_files(directory: str | Path, what: str) -> list[Path]:
    """A checkpoint directory's safetensors files: the shards its index lists, else every one."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise DFlashError(f"{index}: malformed shard index ({e})") from None
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"{what} directory {d} has no *.safetensors weights (only safetensors checkpoints are read)")
    for name in files:
        if not (d / name).is_file():
            raise DFlashError(f"{what} directory {d}: shard {name} listed in the index is missing")
    return [d / name for name in files]


def load_state_dict(directory: str | Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: one file, or shards listed by an index."""
    state: dict[str, torch.Tensor] = {}
    meta = _ON_META.get()
    for path in weight_files(directory, what):
        try:
            state.update(safetensors_torch.load_file(path) if meta is None else _load_some(path, meta))
        except Exception as e:  # safetensors raises its own error types across versions
            raise DFlashError(f"{path}: unreadable safetensors file ({e})") from None
    return state


def _load_some(path: Path, meta: re.Pattern) -> dict[str, torch.Tensor]:
    """One file's tensors, those whose names match `meta` as meta tensors (nothing read)."""
    out = {}
    with safetensors.safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            if meta.search(key):
                sl = f.get_slice(key)
                dtype = getattr(torch, _TORCH_NAMES.get(sl.get_dtype(), sl.get_dtype().lower()))
                out[key] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
            else:
                out[key] = f.get_tensor(key)
    return out


_TORCH_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def strict_load(model: nn.Module, state: dict[str, torch.Tensor], where: str, dtype: torch.dtype, tied: set[str] = frozenset()) -> None:
    """Load into a meta-initialised module; refuse missing, extra or misshapen tensors."""
    expected = {k: v.shape for k, v in model.state_dict().items() if k not in tied}
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if extra:
        more = f" (+{len(extra) - 3} more)" if len(extra) > 3 else ""
        raise DFlashError(f"{where}: unsupported tensors {', '.join(extra[:3])}{more}; this variant is not implemented")
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DFlashError(f"{where}: missing tensors {', '.join(missing[:3])}{more}")
    for k, shape in expected.items():
        if tuple(state[k].shape) != tuple(shape):
            raise DFlashError(f"{where}: tensor {k} has shape {list(state[k].shape)}, expected {list(shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=False)
    for name in tied:  # re-tie after assign replaced the parameter objects
        mod_name, _, attr = name.rpartition(".")
        src = model.get_submodule("model.embed_tokens").weight
        setattr(model.get_submodule(mod_name), attr, src)


def save_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    safetensors_torch.save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path), metadata={"format": "pt"})
