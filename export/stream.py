"""Routed experts streamed from the checkpoint into the target graph's data file, one expert at a time.

A 30B-class MoE target does not fit in memory as fp32 (Qwen3-30B-A3B: ~120 GB), and its
routed experts are ~95% of its weights. Export therefore loads everything else as usual but
the experts as meta tensors (models/checkpoint.py `experts_on_meta`; models/moe.py's
`fuse_experts` still checks every expert tensor's shape against the config), traces the
graphs with zero-stride placeholders in their place (`placeholders`), and gives each expert
initializer of the traced graph a tensor that reads the checkpoint itself when the data
file is written (`attach`, `StreamedExperts`): one expert's [2I, H] or [H, I] at a time, in
either checkpoint layout (per-expert keys or transformers 5.x's fused tensors), converted to
the export dtype (and, for ONNX Runtime's MoE op, to interleaved gate/up rows) on the way.

`export --quantize` writes no float copy of the experts at all: the float export it quantizes
holds one-expert stand-ins (`stand_ins`), and the quantizer reads each expert from the
checkpoint again as it writes its int4 / int8 form (`restore`, `put_back`, `StreamedQuantized`).

The safetensors headers are parsed here and the bytes read with plain file reads rather than
safetensors' mmap: mapped pages would count against the process's memory while the whole
file is copied. bf16 (the released checkpoints' dtype) widens to fp32 by a 16-bit shift.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..runtime.errors import DFlashError, InternalError
from ..runtime.lazy import lazy_import

ir = lazy_import("onnx_ir")  # torch, onnx_ir and the models: on first use (runtime/lazy.py)
torch = lazy_import("torch")
moe = lazy_import("dflash_export.models.moe")
checkpoint = lazy_import("dflash_export.models.checkpoint")
ort_c = lazy_import("onnxruntime.capi._pybind_state")  # quantize_matmul_{4,8}bits

# a routed expert tensor in the checkpoint, either layout (any prefix: model., model.language_model., ...)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$")
# an expert initializer of the traced target graph
INITIALIZER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bf16 read as its bits, widened by a shift


@dataclass
class Entry:
    path: Path
    key: str
    dtype: str  # safetensors' name: F32, F16, BF16
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file


def _header(path: Path) -> tuple[int, dict]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            return n, json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise DFlashError(f"{path}: unreadable safetensors header ({e})") from None


def read_rows(e: Entry, first: int, count: int) -> np.ndarray:
    """`count` rows of the tensor's first axis from `first` on, as float32 (a plain file read)."""
    row = int(np.prod(e.shape[1:], dtype=np.int64))
    itemsize = np.dtype(_NP[e.dtype]).itemsize
    try:
        with open(e.path, "rb") as f:
            f.seek(e.start + first * row * itemsize)
            a = np.fromfile(f, _NP[e.dtype], count * row)
    except OSError as err:
        raise DFlashError(f"{e.path}: cannot read expert tensor {e.key} ({err})") from None
    if a.size != count * row:
        raise DFlashError(f"{e.path}: expert tensor {e.key} ends past the end of the file (truncated or changed "
                          "while exporting)")
    a = a.reshape(count, *e.shape[1:])
    if e.dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


class ExpertReader:
    """Where each layer's routed experts lie in a checkpoint's safetensors files (headers only)."""

    def __init__(self, directory: str | Path):
        self.layers: dict[int, dict] = {}  # layer -> {"fused": {proj: Entry}} or {"per": {e: {proj: Entry}}}
        for path in checkpoint.weight_files(directory, "target"):  # the files the target was loaded from
            n, header = _header(path)
            for key, t in header.items():
                m = _KEY.search(key) if key != "__metadata__" and not key.startswith("mtp.") else None
                if m is None:
                    continue
                if t["dtype"] not in _NP:
                    raise DFlashError(f"{path}: expert tensor {key} is {t['dtype']}; export streams F32, F16 or BF16 experts")
                entry = Entry(path, key, t["dtype"], tuple(t["shape"]), 8 + n + t["data_offsets"][0])
                layer = self.layers.setdefault(int(m.group(1)), {})
                if m.group(4):
                    layer.setdefault("fused", {})[m.group(4)] = entry
                else:
                    layer.setdefault("per", {}).setdefault(int(m.group(2)), {})[m.group(3)] = entry

    def entries(self) -> list[Entry]:
        return [e for layer in self.layers.values()
                for e in [*layer.get("fused", {}).values(), *(x for p in layer.get("per", {}).values() for x in p.values())]]

    def fc1(self, layer: int, expert: int, interleaved: bool, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Expert `expert`'s gate and up rows [2I, H]: gate rows then up rows, or alternating.
        shape: the graph's [E, 2I, H], which the tensors read must agree with (else one line)."""
        where = self.layers[layer]
        if "fused" in where:
            w = read_rows(_checked(where["fused"]["gate_up_proj"], shape), expert, 1)[0]
        else:
            half = None if shape is None else (shape[1] // 2, shape[2])
            g, u = (_checked(where["per"][expert][p], half) for p in ("gate_proj", "up_proj"))
            w = np.concatenate([read_rows(g, 0, g.shape[0]), read_rows(u, 0, u.shape[0])])
        if interleaved:
            w = np.ascontiguousarray(w.reshape(2, -1, w.shape[-1]).transpose(1, 0, 2)).reshape(w.shape)
        return w

    def fc2(self, layer: int, expert: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Expert `expert`'s down projection [H, I]. shape: the graph's [E, H, I] (as in fc1)."""
        where = self.layers[layer]
        if "fused" in where:
            return read_rows(_checked(where["fused"]["down_proj"], shape), expert, 1)[0]
        p = _checked(where["per"][expert]["down_proj"], None if shape is None else shape[1:])
        return read_rows(p, 0, p.shape[0])


def _checked(e: Entry, shape: tuple[int, ...] | None) -> Entry:
    """`e` if its shape is `shape` (None: unchecked). The load checked every expert tensor against
    the config; this catches a checkpoint changed since, as the experts are written."""
    if shape is not None and e.shape != tuple(shape):
        raise DFlashError(f"{e.path.name}: expert tensor {e.key} has shape {list(e.shape)}, but the graph holds "
                          f"{list(shape)} for it (was the checkpoint changed while exporting?)")
    return e


class StreamedExperts(ir.LazyTensor):
    """An [E, N, K] expert initializer whose bytes come from `expert(e)` ([N, K] float32, cast
    to the graph's dtype) only while the data file is written, one expert at a time."""

    def __init__(self, expert, shape: tuple[int, int, int], dtype, name: str):
        self.expert, self.np_dtype = expert, dtype.numpy()
        super().__init__(self._whole, dtype=dtype, shape=ir.Shape(shape), name=name)

    def _whole(self):  # only if something asks for the whole array (export's writer never does)
        return ir.Tensor(np.stack([self._one(e) for e in range(self.shape[0])]), dtype=self.dtype)

    def _one(self, e: int) -> np.ndarray:
        return np.ascontiguousarray(self.expert(e).astype(self.np_dtype, copy=False))

    def tofile(self, file) -> None:
        for e in range(self.shape[0]):
            file.write(self._one(e).tobytes())


def external_experts(t) -> callable:
    """e -> expert e of an [E, N, K] float initializer in external data (the float export's
    data file), read by itself as float32: what `StreamedQuantized` reads when an export's
    experts are quantized after the float export was written."""
    dtype = {ir.DataType.FLOAT: "F32", ir.DataType.FLOAT16: "F16", ir.DataType.BFLOAT16: "BF16"}[t.dtype]
    entry = Entry(Path(t.path), t.name, dtype, tuple(int(d) for d in t.shape), int(t.offset or 0))
    return lambda e: read_rows(entry, e, 1)[0]


def quantize_expert(w: np.ndarray, bits: int, block: int, symmetric: bool = True):
    """One expert [N, K] (float32 or float16) -> (codes uint8 [N, K * bits / 8], scales [N, K / block]
    in w's dtype, zero points uint8 [N, ceil(K / block * bits / 8)] or None when symmetric):
    block-wise round-to-nearest along K by ONNX Runtime's own kernel (the one its MatMulNBits
    quantizer calls), in com.microsoft::QMoE's raw layout (weights_prepacked=0; no zero points:
    QMoE's default 2^(bits-1), the symmetric one)."""
    n, k = w.shape
    blocks = k // block
    codes = np.zeros((n, blocks, block * bits // 8), np.uint8)
    scales = np.zeros((n, blocks), w.dtype)
    zero_points = np.zeros((n, (blocks * bits + 7) // 8), np.uint8)
    fn = {4: ort_c.quantize_matmul_4bits, 8: ort_c.quantize_matmul_8bits}[bits]
    fn(codes, np.ascontiguousarray(w.T), scales, zero_points, block, n, k, symmetric)
    return codes.reshape(n, -1), scales, None if symmetric else zero_points


PARTS = ("codes", "scales", "zero_points")


class StreamedQuantized(ir.LazyTensor):
    """One part of QMoE's quantized form of an [E, N, K] expert tensor: "codes" [E, N, K * bits / 8],
    "scales" [E, N, K / block] or "zero_points" (asymmetric only), each expert read from
    `expert(e)`, cast to `dtype` (the float export's) and quantized only while the data file is
    written: int4 / int8 experts written directly, with no float copy of the layer held. Each
    part reads the source once."""

    def __init__(self, expert, shape: tuple[int, int, int], dtype, bits: int, block: int, part: str, name: str,
                 symmetric: bool = True):
        e, n, k = shape
        if k % block:
            raise DFlashError(f"{name}: its input width {k} is not a multiple of the quantization block {block}")
        self.expert, self.np_dtype, self.bits, self.block = expert, dtype.numpy(), bits, block
        self.symmetric, self.index = symmetric, PARTS.index(part)
        dtype, out = {"codes": (ir.DataType.UINT8, (e, n, k * bits // 8)), "scales": (dtype, (e, n, k // block)),
                      "zero_points": (ir.DataType.UINT8, (e, n, (k // block * bits + 7) // 8))}[part]
        super().__init__(self._whole, dtype=dtype, shape=ir.Shape(out), name=name)

    def _one(self, e: int) -> np.ndarray:
        w = self.expert(e).astype(self.np_dtype, copy=False)
        return quantize_expert(w, self.bits, self.block, self.symmetric)[self.index]

    def _whole(self):  # only if something asks for the whole array (the data file's writer never does)
        return ir.Tensor(np.stack([self._one(e) for e in range(self.shape[0])]), dtype=self.dtype)

    def tofile(self, file) -> None:
        for e in range(self.shape[0]):
            file.write(np.ascontiguousarray(self._one(e)).tobytes())


def put_back(model, aside: dict, bits: int, block: int, symmetric: bool) -> None:
    """After quantizing a graph whose other tensors went through as one-row stand-ins
    (export/quantize.py `set_aside`): a tensor still there gets its float bytes back
    (copied from the float export's file, or streamed from the checkpoint, when written); an
    expert tensor the quantizer turned into QMoE's `<name>_Q<bits>`, `<name>_scales`,
    `<name>_zp<bits>` gets those written expert by expert, quantized as they are written, each
    expert read from the checkpoint (`export --quantize`: a StreamedExperts, `restore`) or
    else from the float export's file (`quantize` of an export)."""
    inits = model.graph.initializers
    for name, t in aside.items():
        if name in inits:
            inits[name].const_value, inits[name].shape = t, t.shape
            continue
        parts = {f"{name}_Q{bits}": "codes", f"{name}_scales": "scales", f"{name}_zp{bits}": "zero_points"}
        found = [n for n in parts if n in inits]
        if not found:
            raise InternalError(f"quantizing dropped the experts {name} without a quantized form of them")
        expert = t.expert if isinstance(t, StreamedExperts) else external_experts(t)
        for n in found:
            v = inits[n]
            v.const_value = StreamedQuantized(expert, tuple(t.shape), t.dtype, bits, block, parts[n], n, symmetric)
            v.shape = v.const_value.shape


def stand_ins(model) -> dict[str, StreamedExperts]:
    """`export --quantize`: each streamed expert initializer of the target graph -> a stand-in of
    one expert of zeros, so that the float export that is quantized afterwards never holds the
    float experts (its graphs still pass validation: shapes but the expert count are the
    real ones). -> name: the streamed tensor, which `restore` gives back to the loaded graph."""
    out = {}
    for value in model.graph.initializers.values():
        t = value.const_value
        if isinstance(t, StreamedExperts):
            out[value.name] = t
            value.const_value = first_row_zeros(t, value.name)
            value.shape = value.const_value.shape
    return out


def first_row_zeros(t, name: str | None = None) -> ir.Tensor:
    """A stand-in of `t`'s first row (a routed expert tensor's: one expert) in zeros: what goes
    through validation and the quantizers in place of a tensor whose bytes stay where they are."""
    return ir.Tensor(np.zeros((1, *t.shape[1:]), t.dtype.numpy()), dtype=t.dtype, name=name)


def restore(model, experts: dict[str, StreamedExperts]) -> None:
    """The float export's target graph, loaded to be quantized, gets its experts back in place of
    the stand-ins (`stand_ins`): streamed from the checkpoint when they are written."""
    inits = model.graph.initializers
    for name, t in experts.items():
        v = inits.get(name)
        if v is None or tuple(v.shape)[1:] != tuple(t.shape)[1:]:
            raise InternalError(f"the float export's target has no stand-in for the experts {name}")
        v.const_value, v.shape = t, t.shape


def placeholders(target, interleaved: bool) -> bool:
    """After loading under `experts_on_meta`: each routed expert parameter still on the meta
    device becomes a zero-stride placeholder (what the tracer needs: a shape and a dtype, no
    memory), laid out as `interleaved` says (the rows `attach`'s reader will write). Returns
    whether any did."""
    streamed = False
    for block in moe.blocks(target):
        ex = block.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)
            if p.device.type == "meta":
                setattr(ex, name, torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False))
                ex.interleaved, streamed = interleaved, True
    return streamed


def attach(model, reader: ExpertReader, interleaved: bool) -> list[str]:
    """Give the traced target graph's expert initializers their checkpoint source; -> their names."""
    names = []
    for value in model.graph.initializers.values():
        m = INITIALIZER.search(value.name)
        if m is None or value.const_value is None:
            continue
        layer, proj = int(m.group(1)), m.group(2)
        if layer not in reader.layers:
            raise DFlashError(f"the checkpoint has no experts for layer {layer}, which the graph holds ({value.name})")
        t = value.const_value
        shape = tuple(t.shape)
        if proj == "gate_up_proj":
            expert = lambda e, layer=layer, shape=shape: reader.fc1(layer, e, interleaved, shape)  # noqa: E731
        else:
            expert = lambda e, layer=layer, shape=shape: reader.fc2(layer, e, shape)  # noqa: E731
        value.const_value = StreamedExperts(expert, shape, t.dtype, value.name)
        names.append(value.name)
    return names


def expert_elements(directory: str | Path) -> int:
    """Elements of the routed experts in a checkpoint (headers only): what export streams."""
    return sum(int(np.prod(e.shape, dtype=np.int64)) for e in ExpertReader(directory).entries())
