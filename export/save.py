"""Saving: graphs with external data, weights stored once, the tokenizer, the graphs' I/O record.

Initializers of 1 KiB and more go to external data aligned for mmap: one `<graph>.data`
per graph, and `shared.data` for every weight that more than one graph holds (the
embedding and LM head of target + draft_block, the drafter's K/V projections of both
drafter graphs), written once and described in the manifest's `shared` table.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np

from ..runtime import contract as C, manifest as M
from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import

onnx = lazy_import("onnx")  # on first use (runtime/lazy.py)
ir = lazy_import("onnx_ir")
helper = lazy_import("onnx.helper")
numpy_helper = lazy_import("onnx.numpy_helper")
onnx_data = lazy_import("onnx.external_data_helper")

ALIGN = 4096  # external-data offsets of large tensors, so ORT can mmap them
INLINE_BELOW = 1024  # bytes: smaller initializers stay in the .onnx file


def shared_names(models: dict) -> dict[str, list[str]]:
    """Weights to store once: name -> graphs, for every initializer of 1 KiB or more that
    several graphs hold with the same name and the same bytes (the same parameter), and
    the shared embedding / LM head."""
    where: dict[str, list[str]] = {}
    for graph, model in models.items():
        for value in model.graph.initializers.values():
            t = value.const_value
            if t is not None and t.nbytes >= INLINE_BELOW:
                where.setdefault(value.name, []).append(graph)
    # bytes are hashed only where a name recurs: a graph's own weights (a MoE target's streamed
    # experts, export/stream.py) are never read here
    return {n: g for n, g in where.items() if n in C.SHARED_INITIALIZERS or (
        len(g) > 1 and len({_digest(models[x].graph.initializers[n].const_value) for x in g}) == 1)}


def _digest(t) -> str:
    return hashlib.sha256(np.ascontiguousarray(t.numpy()).view(np.uint8)).hexdigest()


class DataWriter:
    """Moves initializers of 1 KiB and more into external data; weights several graphs hold
    into shared.data, once (`shared`: name -> M.SharedTensor, the manifest's table).
    `aliases` (name -> name): tensors stored as the other's bytes, each under its own shape
    (a tied head is the table; a quantized tied head and the quantized table are the same bytes).

    Tensors are streamed from their torch storage one at a time (no copy of the model),
    which keeps peak memory near the weights' size even above protobuf's 2 GB limit.
    """

    def __init__(self, root: Path, shared: dict[str, list[str]], aliases: dict[str, str], bar=None):
        self.root, self.bar = root, bar  # bar: export/progress.py Bar, advanced per tensor written
        self.files: dict[str, object] = {}
        self.share = shared  # name -> graphs holding it
        self.aliases = aliases
        self.written: dict[str, tuple[int, int]] = {}  # name whose bytes -> (offset, length) in shared.data
        self.shared: dict[str, M.SharedTensor] = {}

    def _append(self, fname: str, tensor) -> tuple[int, int]:
        f = self.files.get(fname)
        if f is None:
            f = self.files[fname] = open(self.root / fname, "wb")
        nbytes = tensor.nbytes
        pos = f.tell()
        pad = (-pos) % (ALIGN if nbytes >= ALIGN else 64)
        f.write(b"\0" * pad)
        offset = f.tell()
        tensor.tofile(f)
        length = f.tell() - offset
        if self.bar is not None:
            self.bar.advance(length, tensor.name or "")
        if length != nbytes:
            raise DFlashError(f"writing {tensor.name}: wrote {length} bytes, expected {nbytes}")
        return offset, length

    def _shared(self, name: str, t) -> M.SharedTensor:
        owner = self.aliases.get(name, name)
        where = self.written.get(owner)
        if where is None:
            where = self.written[owner] = self._append(C.SHARED_DATA, t)
        offset, length = where
        if length != t.nbytes:
            raise DFlashError(f"shared tensor {name} is {t.nbytes} bytes, {owner}'s are {length}")
        entry = self.shared.get(name)
        if entry is None:
            entry = self.shared[name] = M.SharedTensor(C.SHARED_DATA, offset, length, t.dtype.numpy().name,
                                                       list(t.shape), [])
        if (entry.dtype, entry.shape) != (t.dtype.numpy().name, list(t.shape)):
            raise DFlashError(f"shared tensor {name} differs between graphs: {entry.shape} vs {list(t.shape)}")
        return entry

    def externalize(self, graph: str, model) -> None:
        for value in list(model.graph.initializers.values()):
            t = value.const_value
            if value.name in self.share:
                entry = self._shared(value.name, t)
                if graph not in entry.graphs:
                    entry.graphs.append(graph)
                fname, offset, length = entry.file, entry.offset, entry.length
            elif t.nbytes < INLINE_BELOW:
                continue  # shape constants (axes, shapes) stay inline, where shape inference reads them
            else:
                fname = f"{graph}.data"
                offset, length = self._append(fname, t)
            value.const_value = ir.ExternalTensor(
                fname, offset, length, t.dtype, shape=t.shape, name=value.name, base_dir=self.root
            )

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def read_initializers(root: Path, model, names) -> dict[str, np.ndarray]:
    """The initializers of `model` (an onnx ModelProto loaded without its external data) named
    in `names`, as arrays: only their own bytes are read from the files beside it in `root`."""
    out = {}
    for t in model.graph.initializer:
        if t.name in names:
            if onnx_data.uses_external_data(t):  # into a copy: the caller's model keeps no bytes
                t = onnx.TensorProto.FromString(t.SerializeToString())
                onnx_data.load_external_data_for_tensor(t, str(root))
            out[t.name] = numpy_helper.to_array(t)
    return out


def save_graph(model, path: Path) -> None:
    proto = ir.serde.serialize_model(model)  # initializers are external references: small
    for node in proto.graph.node:  # the exporter's per-node stack traces: most of the file, no use
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.save_model(proto, str(path))


def save_graphs(out: Path, models: dict, aliases: dict[str, str], bar=None) -> dict:
    """Every graph with its weights in external data (shared ones once, `aliases` as the bytes of
    another: DataWriter); returns the manifest's shared table. bar: advanced per tensor written."""
    share = shared_names(models)
    writer = DataWriter(out, share, aliases, bar)
    if bar is not None:
        sizes = {(g if v.name not in share else "", v.name): v.const_value.nbytes for g, m in models.items()
                 for v in m.graph.initializers.values() if v.const_value is not None and v.const_value.nbytes >= INLINE_BELOW}
        bar.start(sum(sizes.values()))
    try:
        for name, model in models.items():
            writer.externalize(name, model)
            save_graph(model, out / C.GRAPH_FILES[name])
    finally:
        writer.close()
    return writer.shared


def copy_tokenizer(target_dir: Path, out: Path) -> list[str]:
    copied = []
    for name in C.TOKENIZER_FILES:
        src = Path(target_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    return copied


def graph_spec(path: Path) -> M.GraphSpec:
    model = onnx.load(str(path), load_external_data=False)

    def spec(v) -> M.TensorSpec:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]
        name = helper.tensor_dtype_to_np_dtype(t.elem_type).name
        return M.TensorSpec(v.name, name if name != "bfloat16" else "bfloat16", dims)

    return M.GraphSpec(path.name, [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output])


def opset_of(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
