"""Weight-only int4 / int8 quantization of exported graphs, by ONNX Runtime's own quantizer.

`onnxruntime.quantization.MatMulNBitsQuantizer` (round-to-nearest, blockwise along the
input dimension) replaces each `MatMul(x, W)` whose W is a constant [in, out] initializer
with `com.microsoft::MatMulNBits(x, W_Q, W_scales[, W_zero_points])`; export/trace.py's
`store_transposed` puts the weights in that layout first. Only linear weights are touched:
attention's MatMuls have no constant input, and the embedding lookup (Gather) keeps the
export dtype. The LM head stays in the export dtype unless asked for; its quantized tensors
(`lm_head.weight_Q4`, ...) are shared initializers like the head itself, written once.

The graphs then need ONNX Runtime (CPU, CUDA and DirectML providers have MatMulNBits);
TensorRT's parser does not take it (export/trt_lint.py refuses such graphs).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..runtime import contract as C, manifest as M
from ..errors import DFlashError
from ..lazy import lazy_import
from .ops import QUANT_OPS
from .outdir import check_out_dir, commit, write_manifest_checked
from .progress import Phases, report
from .save import graph_spec, save_graphs
from .trace import store_transposed
from .validate import validate_artifact

ir = lazy_import("onnx_ir")  # onnx, onnxruntime's quantizer, torch: on first use (lazy.py)
nbits = lazy_import("onnxruntime.quantization.matmul_nbits_quantizer")
onnx = lazy_import("onnx")
numpy_helper = lazy_import("onnx.numpy_helper")
torch = lazy_import("torch")
moe = lazy_import("dflash_export.export.moe")

SCHEMES = {"int4": 4, "int8": 8}
ROUTERS = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")  # MoE routing weights: kept in the export dtype


@dataclass
class QuantOptions:
    """What `export --quantize` asked for; `record()` is the manifest's `quantization`."""

    scheme: str  # "int4" | "int8"
    block_size: int = 32
    symmetric: bool = True
    draft: bool = False  # also the drafter's linear layers (draft_context, draft_block)
    lm_head: bool = False  # also the LM head (shared by target and draft_block)
    accuracy_level: int | None = None  # MatMulNBits' compute type on CPU (None: the provider's default)

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    def graphs(self) -> tuple[str, ...]:
        """Graphs whose linear layers are quantized (the shared LM head goes with `lm_head`)."""
        return (C.TARGET, C.DRAFT_CONTEXT, C.DRAFT_BLOCK) if self.draft else (C.TARGET,)

    def quantizes(self, graph: str, weight: str) -> bool:
        if weight.endswith(ROUTERS):  # an MoE router: a rounded logit would choose other experts
            return False
        if weight in C.SHARED_INITIALIZERS:  # the head: in both graphs or in neither, so it stays one copy
            return self.lm_head
        return graph in self.graphs()

    def record(self, weights: dict[str, list[str]]) -> dict:
        d = asdict(self)
        d.update(method="onnxruntime MatMulNBitsQuantizer (RTN, blockwise)", bits=self.bits, weights=weights)
        return d


def check_options(q: QuantOptions, dtype: str) -> None:
    """Refuse what cannot work, before anything is loaded."""
    if q.scheme not in SCHEMES:
        raise DFlashError(f"--quantize {q.scheme} is not supported; choose int4 or int8 (weight-only, ONNX Runtime MatMulNBits)")
    if dtype == "bf16":
        raise DFlashError("--quantize with --dtype bf16 is not supported (ONNX Runtime's CPU MatMulNBits has no bf16 "
                          "kernel); export with --dtype fp32 or fp16")
    if q.block_size < 16 or q.block_size & (q.block_size - 1):
        raise DFlashError(f"--quant-block-size {q.block_size}: MatMulNBits takes a power of two >= 16 (e.g. 32, 64, 128)")
    if q.accuracy_level not in (None, 0, 1, 2, 3, 4):
        raise DFlashError(f"--quant-accuracy-level {q.accuracy_level}: MatMulNBits takes 0-4")


def quantize_graph(model, q: QuantOptions, graph: str):
    """onnx_ir model -> (quantized onnx_ir model, names of the weights that were quantized)."""
    for i, node in enumerate(model.graph):  # the quantizer selects nodes by name
        node.name = node.name or f"node_{i}"
    ir.external_data.load_to_model(model)  # the quantizer reads weights as arrays from the proto
    proto = ir.serde.serialize_model(model)
    inits = {t.name for t in proto.graph.initializer}
    linear = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    exclude = [n.name for n in linear if not q.quantizes(graph, n.input[1])]
    quantizer = nbits.MatMulNBitsQuantizer(proto, bits=q.bits, block_size=q.block_size, is_symmetric=q.symmetric,
                                     accuracy_level=q.accuracy_level, nodes_to_exclude=exclude)
    logger = logging.getLogger("onnxruntime.quantization")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            quantizer.process()
    finally:
        logger.setLevel(level)
    out = quantizer.model.model
    quantized = sorted(n.input[1] for n in linear if n.name not in exclude)
    done = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    if len(done) != len(quantized):
        raise DFlashError(f"ONNX Runtime's quantizer converted {len(done)} of {len(quantized)} linear layers; "
                          "re-export without --quantize")
    if graph == C.TARGET:  # an MoE export's experts (--moe op): com.microsoft::MoE -> QMoE
        quantized += moe.to_qmoe(out, q.bits, q.block_size, q.symmetric, q.accuracy_level)
    del proto
    return ir.serde.deserialize_model(out), quantized


def quantize_artifact(src, out, q: QuantOptions, *, force: bool = False, progress: bool = True) -> M.Manifest:
    """A float artifact directory (`export` output) -> a weight-only quantized one at `out`.

    Graphs are read with their external data mapped, quantized one at a time and written
    like the export writes them (shared tensors once in shared.data, the rest as external
    data of their graph), validated and described in a new manifest. Atomic like `export`.
    """
    src, out = Path(src), Path(out).absolute()
    m = M.load_manifest(src, verify=True)
    if m.quantization is not None:
        raise DFlashError(f"{src} is already quantized ({m.quantization['scheme']}); quantize its float export "
                          "(or re-export from the checkpoints with --quantize)")
    check_options(q, m.dtype)
    if (m.moe or {}).get("path") == "standard":
        raise DFlashError(f"{src} runs its experts in standard ops (--moe standard), whose gathered expert weights have "
                          "no quantized form here; quantize an --moe op export (ONNX Runtime's QMoE)")
    check_out_dir(out, force)
    ui = Phases(progress)
    t0 = time.perf_counter()
    tmp = out.parent / f".{out.name}.partial-q{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    embed, head = C.SHARED_INITIALIZERS
    quantized: dict[str, list[str]] = {}
    try:
        tmp.mkdir()
        with ui.phase("quantize", f"{q.scheme}, block {q.block_size}, {'symmetric' if q.symmetric else 'asymmetric'}: "
                                  f"{', '.join(q.graphs())}{' + LM head' if q.lm_head else ''} (onnxruntime)"):
            models, tied = {}, False
            for name, f in C.GRAPH_FILES.items():
                model = ir.load(src / f)  # external data stays on disk until a tensor is read
                inits = model.graph.initializers
                if name == C.TARGET:
                    tied = head in inits and embed in inits and _same_bytes(inits[head], inits[embed])
                # a tied head keeps the table's bytes unless quantized: then it needs its own [in, out] layout
                store_transposed(model, keep=(head,) if tied and not q.lm_head else ())
                if name in q.graphs() or (q.lm_head and head in inits):
                    model, quantized[name] = quantize_graph(model, q, name)
                    if not quantized[name]:
                        raise DFlashError(f"{f} has no linear layer with a constant weight to quantize")
                models[name] = model
            # shared: the embedding, and what several graphs hold with the same bytes (a quantized
            # head, the drafter's K/V projections); quantization is deterministic, so they match
            shared = save_graphs(tmp, models, tied and not q.lm_head)
            del models
            for name in C.TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, tmp / name)
        with ui.phase("validate", "onnx.checker, shape inference, op lint, ORT load"):
            validate_artifact(tmp, m.dtype, quantized=True, attention=m.attention, moe=(m.moe or {}).get("path"))
        specs = {name: graph_spec(tmp / f) for name, f in C.GRAPH_FILES.items()}
        manifest = dataclasses.replace(m, graphs=specs, files={}, engines=None, shared=shared,
                                       quantization=q.record(quantized))
        write_manifest_checked(tmp, manifest)
        commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report(ui, out, time.perf_counter() - t0)
    return manifest


def _same_bytes(a, b) -> bool:
    """Two initializers stored at the same place of the same external file (tied weights)."""
    ta, tb = a.const_value, b.const_value
    where = lambda t: (getattr(t, "location", None), getattr(t, "offset", None))  # noqa: E731
    return where(ta) == where(tb) and where(ta)[0] is not None


def dequantize(node, arrays: dict) -> np.ndarray:
    """A MatMulNBits node's weight as the float [N, K] matrix it multiplies by (x @ W.T),
    from its packed inputs, per ONNX Runtime's contrib-op spec: B uint8 [N, blocks, blob]
    (4 bits: two values a byte, low nibble first), scales [N * blocks], zero points packed
    the same way (absent: 2^(bits-1)). Written here, not taken from ORT, so that `check`
    compares the graphs with an independent reading of their weights."""
    attr = {a.name: a.i for a in node.attribute}
    n, k, bits, bs = attr["N"], attr["K"], attr["bits"], attr["block_size"]
    ins = list(node.input) + [""] * 4
    b, scales = arrays[ins[1]], arrays[ins[2]].astype(np.float32).reshape(n, -1)
    blocks = scales.shape[1]
    if bits == 4:
        b = b.reshape(n, -1)
        q = np.stack([b & 0x0F, b >> 4], -1).reshape(n, blocks, bs)
    elif bits == 8:
        q = b.reshape(n, blocks, bs)
    else:
        raise DFlashError(f"MatMulNBits {node.name}: {bits} bits is not int4 or int8")
    if ins[3]:
        zp = arrays[ins[3]]
        if zp.dtype != np.uint8:
            raise DFlashError(f"MatMulNBits {node.name}: float zero points are not produced by this exporter")
        zp = zp.reshape(n, -1)
        if bits == 4:
            zp = np.stack([zp & 0x0F, zp >> 4], -1).reshape(n, -1)
        zp = zp[:, :blocks].astype(np.float32)
    else:
        zp = np.full((n, blocks), 2.0 ** (bits - 1), np.float32)
    w = (q.astype(np.float32) - zp[..., None]) * scales[..., None]
    return w.reshape(n, blocks * bs)[:, :k]


def dequantized_weights(root) -> dict[str, dict[str, np.ndarray]]:
    """graph -> {float weight name: [N, K] float32} for every MatMulNBits of a quantized artifact
    (and [E, N, K] for the experts of each QMoE)."""
    out = {}
    for graph, f in C.GRAPH_FILES.items():
        model = onnx.load(str(Path(root) / f), load_external_data=False)
        nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        experts = [n for n in model.graph.node if n.op_type == "QMoE"]
        if not nodes and not experts:
            continue
        wanted = {i for n in nodes for i in n.input[1:]} | {i for n in experts for i in n.input[2:]}
        arrays = {}
        for t in model.graph.initializer:
            if t.name in wanted:
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    onnx.external_data_helper.load_external_data_for_tensor(t, str(Path(root)))
                arrays[t.name] = numpy_helper.to_array(t)
        out[graph] = {n.input[1].rsplit("_Q", 1)[0]: dequantize(n, arrays) for n in nodes}
        for n in experts:
            out[graph].update(moe.dequantize_qmoe(n, arrays))
    return out


def dequantized_sources(root: Path, target, drafter):
    """Copies of the PyTorch modules holding the weights the quantized graphs multiply by, or
    (None, why) when a quantized weight is not a parameter of the source."""
    qt, qd = copy.deepcopy(target), copy.deepcopy(drafter)
    head = C.SHARED_INITIALIZERS[1]
    for graph, weights in dequantized_weights(root).items():
        module = qt if graph == C.TARGET else qd
        for name, w in weights.items():
            if name == head:  # one head for both graphs; a tied one is untied, the lookup keeps the float table
                p = qt.lm_head.weight
                qt.lm_head.weight = torch.nn.Parameter(torch.from_numpy(w).to(p.dtype), requires_grad=False)
                continue
            try:
                p = module.get_parameter(name)
            except AttributeError:
                try:
                    p = module.get_buffer(name)  # a reduced draft vocabulary's [N, H] head (vocab_head)
                except AttributeError:
                    return None, f"{graph}: {name} is not a parameter of the PyTorch source"
            if tuple(p.shape) != w.shape:
                return None, f"{graph}: {name} is {tuple(p.shape)} in PyTorch, {w.shape} dequantized"
            p.data = torch.from_numpy(w).to(p.dtype)
    return (qt, qd), None
