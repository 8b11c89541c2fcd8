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


def read_rows(e: Entry, first: int = 0, count: int | None = None) -> np.ndarray:
    """`count` rows of the tensor's first axis from `first` on (None: the rest; a scalar whole), as
    float32 (a plain file read)."""
    a = read_native(e, first, count)
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


# -- every weight: the float model is never held ------------------------------------------
#
# `export` of a dense target and a z-lab drafter loads both with every checkpoint tensor on the
# meta device (models/checkpoint.py `experts_on_meta` with ALL), gives each parameter a
# zero-stride placeholder (`placeholders_all`: a shape and a dtype, one element of memory),
# traces the graphs on those, and then points each initializer that came from a placeholder at
# its tensor in the checkpoint (`attach_all`): its bytes are read, converted to the export dtype
# (by torch, exactly as loading would) and written one tensor at a time, in chunks, when the
# data file is written; `export --quantize` quantizes each linear weight as it is read
# (export/quantize.py `quantize_streamed`). Memory: the largest tensor in the checkpoint's dtype
# plus one chunk; disk: the artifact.

ALL = re.compile("")  # every key: experts_on_meta(ALL) loads no tensor at all
CHUNK_BYTES = 16 << 20  # converted and written per read


def checkpoint_entries(directory: str | Path, what: str) -> dict[str, Entry]:
    """key -> where a checkpoint's tensor lies (headers only), for the files it is loaded from."""
    out = {}
    for path in checkpoint.weight_files(directory, what):
        n, header = _header(path)
        for key, t in header.items():
            if key != "__metadata__":
                out[key] = Entry(path, key, t["dtype"], tuple(t["shape"]), 8 + n + t["data_offsets"][0])
    return out


def placeholders_all(module, entries: dict[str, Entry], where: str) -> dict[int, Entry]:
    """Every parameter of `module` still on the meta device -> a zero-stride placeholder of its
    shape and dtype; -> {the placeholder's storage address: its checkpoint tensor}, what
    `attach_all` recognises the traced initializers by (a name may change on the way; the
    address of the storage the tracer keeps does not)."""
    sources = {}
    for name, p in list(module.named_parameters()):
        if p.device.type != "meta":
            continue
        e = entries.get(name)
        if e is None or e.dtype not in _NP or tuple(e.shape) != tuple(p.shape):
            raise InternalError(f"{where}: parameter {name} has no streamable checkpoint tensor of its shape")
        mod_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(mod_name) if mod_name else module
        ph = torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False)
        setattr(owner, attr, ph)
        sources[ph.untyped_storage().data_ptr()] = e
    for name, b in module.named_buffers():
        if b is not None and b.device.type == "meta":
            raise InternalError(f"{where}: buffer {name} was not loaded")
    return sources


def retie(target) -> None:
    """A tied target's LM head is its embedding's parameter again (placeholders_all replaced it)."""
    if target.config.tie_word_embeddings:
        target.lm_head.weight = target.model.embed_tokens.weight


def _torch_dtype(np_dtype):
    return {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}.get(np.dtype(np_dtype), torch.bfloat16)


def convert(a: np.ndarray, src_dtype: str, dtype, transpose: bool = False) -> np.ndarray:
    """Checkpoint values (numpy, bf16 as uint16 bits) -> the export dtype (an ir.DataType), by
    torch's own cast: the bytes loading the model and casting it would give. transpose: a
    matrix comes out transposed (contiguous), transposed before it is widened: in the
    checkpoint's 2 bytes and by torch's blocked copy, 3-4x faster than numpy's copy of the
    widened .T at Qwen3-8B's MLP shape."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if src_dtype == "BF16":
        t = t.view(torch.bfloat16)
    if transpose:
        t = t.t().contiguous()
    want = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16}[dtype]
    t = t.to(want)
    if want is torch.bfloat16:
        return t.view(torch.uint16).numpy() if hasattr(torch, "uint16") else t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _contiguous(a: np.ndarray) -> memoryview:
    """a's bytes for file.write without the copy `tobytes` makes (one chunk less held)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def read_native(e: Entry, first: int = 0, count: int | None = None) -> np.ndarray:
    """Rows [first, first + count) of a checkpoint tensor in its own dtype (bf16 as uint16 bits)."""
    shape = e.shape if e.shape else (1,)
    count = shape[0] - first if count is None else count
    row = int(np.prod(shape[1:], dtype=np.int64))
    itemsize = np.dtype(_NP[e.dtype]).itemsize
    try:
        with open(e.path, "rb") as f:
            f.seek(e.start + first * row * itemsize)
            a = np.fromfile(f, _NP[e.dtype], count * row)
    except OSError as err:
        raise DFlashError(f"{e.path}: cannot read tensor {e.key} ({err})") from None
    if a.size != count * row:
        raise DFlashError(f"{e.path}: tensor {e.key} ends past the end of the file (truncated or changed while exporting)")
    return a.reshape(count, *shape[1:]) if e.shape else a.reshape(())


class StreamedWeight(ir.LazyTensor):
    """A weight whose bytes are read from the checkpoint only when asked for: written in chunks
    of rows (`tofile`), or whole (`numpy`, for one tensor at a time: the quantizer's input).
    `transposed`: the [in, out] layout MatMul consumes (export/trace.py `store_transposed`)."""

    def __init__(self, entry: Entry, dtype, name: str | None = None, transposed: bool = False):
        self.entry, self.transposed_ = entry, transposed
        shape = entry.shape[::-1] if transposed else entry.shape
        super().__init__(self._whole, dtype=dtype, shape=ir.Shape(shape), name=name)

    def transposed(self) -> "StreamedWeight":
        if len(self.entry.shape) != 2:
            raise InternalError(f"{self.entry.key}: only a matrix is transposed")
        return StreamedWeight(self.entry, self.dtype, self.name, not self.transposed_)

    def array(self) -> np.ndarray:
        """The whole tensor in the export dtype (bf16 as ml_dtypes' bfloat16), as stored."""
        a = convert(read_native(self.entry), self.entry.dtype, self.dtype, transpose=self.transposed_)
        return a.view(self.dtype.numpy()) if self.dtype == ir.DataType.BFLOAT16 else a

    def _whole(self):
        return ir.Tensor(self.array(), dtype=self.dtype)

    def tofile(self, file) -> None:
        e = self.entry
        if not e.shape:
            file.write(_contiguous(convert(read_native(e), e.dtype, self.dtype)))
            return
        width = int(np.prod(self.shape[1:], dtype=np.int64)) * int(self.dtype.itemsize)
        rows = max(1, CHUNK_BYTES // max(1, width))
        if not self.transposed_:
            for r in range(0, e.shape[0], rows):
                file.write(_contiguous(convert(read_native(e, r, min(rows, e.shape[0] - r)), e.dtype, self.dtype)))
            return
        src = read_native(e)  # [out, in] in the checkpoint's dtype: the output's rows are its columns
        for c in range(0, e.shape[1], rows):
            file.write(_contiguous(convert(src[:, c:c + rows], e.dtype, self.dtype, transpose=True)))


def attach_all(model, sources: dict[int, Entry]) -> int:
    """Each initializer of a traced graph that holds a placeholder (`placeholders_all`) -> a
    StreamedWeight of its checkpoint tensor; -> how many. A placeholder left would be written
    as its zeros: refused."""
    n = 0
    for value in model.graph.initializers.values():
        t = value.const_value
        raw = getattr(t, "raw", None)
        if not isinstance(raw, torch.Tensor):
            continue
        e = sources.get(raw.untyped_storage().data_ptr())
        if e is None:
            if raw.numel() > 1 and 0 in raw.stride():
                raise InternalError(f"{value.name}: a placeholder the export cannot trace back to the checkpoint")
            continue
        if tuple(raw.shape) != tuple(e.shape):
            raise InternalError(f"{value.name}: traced as {list(raw.shape)}, the checkpoint's {e.key} is {list(e.shape)}")
        value.const_value = StreamedWeight(e, t.dtype, value.name)
        n += 1
    return n


class QuantizedWeight(ir.LazyTensor):
    """One part of ONNX Runtime's MatMulNBits form of a streamed [K, N] weight: "codes" uint8
    [N, K / block, block * bits / 8], "scales" [N, K / block] (the weight's dtype) or
    "zero_points" uint8 (asymmetric only), computed by ONNX Runtime's C++ quantizer (the one its
    MatMulNBitsQuantizer calls, so the bytes are the same) as the data file is written. The parts
    of one weight share one quantization: the last weight's result is kept until its parts are
    written (they are written one after the other)."""

    _last: tuple = (None, None)  # (the weight, its (codes, scales, zero points)): one at a time

    def __init__(self, weight: StreamedWeight, bits: int, block: int, symmetric: bool, part: str, name: str):
        k, n = (int(d) for d in weight.shape)
        blocks = -(-k // block)  # a last partial block is padded with zeros, as ONNX Runtime's quantizer pads it
        self.weight, self.bits, self.block, self.symmetric, self.index = weight, bits, block, symmetric, PARTS.index(part)
        suffix = {"codes": f"_Q{bits}", "scales": "_scales", "zero_points": "_zero_points"}[part]
        dtype, shape = {"codes": (ir.DataType.UINT8, (n, blocks, block * bits // 8)), "scales": (weight.dtype, (n, blocks)),
                        "zero_points": (ir.DataType.UINT8, (n, (blocks * bits + 7) // 8))}[part]
        super().__init__(self._whole, dtype=dtype, shape=ir.Shape(shape), name=name + suffix)

    @classmethod
    def parts(cls, weight: StreamedWeight, bits: int, block: int, symmetric: bool, name: str) -> dict:
        """name: the graph's name of the weight (a tied head shares its tensor with the table)."""
        names = ("codes", "scales") if symmetric else PARTS
        return {p: cls(weight, bits, block, symmetric, p, name) for p in names}

    def _quantized(self):
        w, result = QuantizedWeight._last
        key = (self.weight.entry, self.weight.transposed_, self.weight.dtype, self.bits, self.block, self.symmetric)
        if w != key:
            a = self.weight.array()  # [K, N] in the export dtype: what the quantizer would read from the graph
            k, n = a.shape
            if k % self.block:  # padded with zero rows, the kernel still told K (as ONNX Runtime's quantizer does)
                a = np.pad(a, ((0, -k % self.block), (0, 0)))
            blocks = a.shape[0] // self.block
            codes, scales, zp = (np.zeros(s, t) for s, t in zip(
                [(n, blocks, self.block * self.bits // 8), (n, blocks), (n, (blocks * self.bits + 7) // 8)],
                [np.uint8, a.dtype, np.uint8]))
            fn = {4: ort_c.quantize_matmul_4bits, 8: ort_c.quantize_matmul_8bits}[self.bits]
            fn(codes, a, scales, zp, self.block, n, k, self.symmetric)
            del a
            result = (codes, scales, zp)
            QuantizedWeight._last = (key, result)
        return result[self.index]

    def _whole(self):
        return ir.Tensor(self._quantized(), dtype=self.dtype)

    def tofile(self, file) -> None:
        file.write(_contiguous(self._quantized()))


def stand_ins_all(models: dict) -> dict[str, dict[str, StreamedWeight]]:
    """`export --quantize` of a pair whose every weight streams: each graph's streamed
    initializers -> stand-ins of their first row (export/stream.py `first_row_zeros`), so the
    float export the quantizer starts from holds no weight; -> graph: {name: the streamed tensor},
    which the quantizer gives back (`restore`) and writes, quantized or not, from the checkpoint."""
    out = {}
    for graph, model in models.items():
        out[graph] = {}
        for value in model.graph.initializers.values():
            t = value.const_value
            if isinstance(t, StreamedWeight):
                out[graph][value.name] = t
                value.const_value = first_row_zeros(t, value.name)
                value.shape = value.const_value.shape
    return out
