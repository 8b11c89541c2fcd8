"""Weight-only int4 / int8 quantization of exported graphs, by ONNX Runtime's own quantizer.

`onnxruntime.quantization.MatMulNBitsQuantizer` (round-to-nearest, blockwise along the
input dimension) replaces each `MatMul(x, W)` whose W is a constant [in, out] initializer
with `com.microsoft::MatMulNBits(x, W_Q, W_scales[, W_zero_points])`; export/trace.py's
`store_transposed` puts the weights in that layout first. Only linear weights are touched:
attention's MatMuls have no constant input. The LM head and the embedding lookup stay in the
export dtype unless asked for; their quantized tensors (`lm_head.weight_Q4`, ...) are shared
initializers like the float ones, written once. The lookup, asked for, becomes
`com.microsoft::GatherBlockQuantized` over the table quantized exactly as MatMulNBits would
quantize it as a head (the same function on the table's transpose): with tied embeddings the
two read the same bytes of shared.data.

MatMulNBits' accuracy_level (0: fp32 activations; 4: activations quantized to int8 per block,
int8 dot products) is chosen per artifact by measurement (export/accuracy_level.py) unless given.

The block size, unless given, is DEFAULT_BLOCK[scheme] (quant_options.py `default_block_size`): blocks of 128
(the common int4 group size, ONNX Runtime's quantizer's own default), measured on CPU at the
Qwen3-0.6B shape to cost about 60 % (int4) and 65 % (int8) of block 32's CPU time per token at
a modestly larger error (docs/quantization.md, "Block size"), halved until it divides the hidden
size and an MoE target's expert width (QMoE's blocks run along both).

The graphs then need ONNX Runtime (CPU, CUDA and DirectML providers have MatMulNBits);
TensorRT's parser does not take it (export/trt_lint.py refuses such graphs).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from ..runtime import contract as C, manifest as M
from ..runtime.errors import DFlashError, InternalError
from ..runtime.lazy import lazy_import
from ..runtime.outdir import check_out_dir, commit, staged, write_manifest_checked
from . import accuracy_level as AL, even_rows
from .progress import Phases, report
from .quant_options import DRAFT_ONLY_LEVEL, QuantOptions, check_options, default_block_size
from . import stream
from .save import INLINE_BELOW, graph_spec, read_initializers, save_graphs
from .trace import store_transposed
from .validate import validate_artifact

ir = lazy_import("onnx_ir")  # onnx, onnxruntime's quantizer, torch: on first use (runtime/lazy.py)
nbits = lazy_import("onnxruntime.quantization.matmul_nbits_quantizer")
ort_pybind = lazy_import("onnxruntime.capi._pybind_state")  # its C++ blockwise quantizer (pack_blocks)
onnx = lazy_import("onnx")
torch = lazy_import("torch")
moe = lazy_import("dflash_export.export.moe")
moe_blocks = lazy_import("dflash_export.models.moe")


def quantize_graph(model, q: QuantOptions, graph: str):
    """onnx_ir model -> (quantized onnx_ir model, names of the weights that were quantized).

    Only the linear weights to quantize go through ONNX Runtime's quantizer (a protobuf of the
    graph, quantized in place): every other initializer goes through as a one-row stand-in and
    keeps its bytes on disk (`set_aside`), so the embedding, a float head and a MoE target's
    experts are never held, let alone copied into the protobuf."""
    for i, node in enumerate(model.graph):  # the quantizer selects nodes by name
        node.name = node.name or f"node_{i}"
    inits = model.graph.initializers
    linear = [n for n in model.graph if n.op_type == "MatMul" and len(n.inputs) == 2 and n.inputs[1] is not None
              and n.inputs[1].name in inits and inits[n.inputs[1].name].const_value is not None]
    chosen = {n.inputs[1].name for n in linear if q.quantizes(graph, n.inputs[1].name)}
    if chosen and all(isinstance(inits[n].const_value, stream.StreamedWeight) for n in chosen):
        return quantize_streamed(model, q, linear, chosen), sorted(chosen)
    aside = set_aside(model, keep=chosen)
    ir.external_data.load_to_model(model)  # the quantizer reads weights as arrays from the proto
    out = ir.serde.serialize_model(model)
    del model
    head = {C.SHARED_INITIALIZERS[1]}  # at its own bits (--quant-head-bits): a pass of its own
    passes = [(q, chosen)] if q.head() is q else [(q, chosen - head), (q.head(), chosen & head)]
    for opts, names in passes:
        if names:
            out = _run_quantizer(out, opts, [n.name for n in linear if n.inputs[1].name not in names])
    quantized = sorted(chosen)
    done = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    if len(done) != len(quantized):
        raise DFlashError(f"ONNX Runtime's quantizer converted {len(done)} of {len(quantized)} linear layers; "
                          "re-export without --quantize")
    if graph == C.TARGET:  # an MoE export's experts: --moe op's MoE nodes -> QMoE; --moe standard's gathered
        quantized += moe.to_qmoe(out, q.bits, q.block_size, q.symmetric)  # tensors -> codes dequantized after the gather
        quantized += moe.to_gathered(out, q.bits, q.block_size, q.symmetric)
    model = ir.serde.deserialize_model(out)
    del out
    stream.put_back(model, aside, q.bits, q.block_size, q.symmetric)
    return model, quantized


def quantize_streamed(model, q: QuantOptions, linear: list, chosen: set[str]):
    """quantize_graph for weights that stream from the checkpoint (export/stream.py): each chosen
    MatMul becomes the MatMulNBits node ONNX Runtime's quantizer would make (same name, inputs,
    attributes, initializer order), over codes and scales its own C++ kernel computes from one
    weight at a time as the data file is written. Nothing else of the graph is touched."""
    if any(n.op_type in ("MoE", "QMoE") for n in model.graph):
        raise InternalError("quantize_streamed: a graph with experts streams them by export/stream.py's own path")
    head = C.SHARED_INITIALIZERS[1]
    passes = [(q, chosen)] if q.head() is q else [(q, chosen - {head}), (q.head(), chosen & {head})]
    inits = model.graph.initializers
    for opts, names in passes:  # in the order ONNX Runtime's quantizer runs: graph order, the head's pass last
        for node in [n for n in linear if n.inputs[1].name in names]:
            w = node.inputs[1]
            k, n = (int(d) for d in w.shape)
            parts = stream.QuantizedWeight.parts(w.const_value, opts.bits, opts.block_size, opts.symmetric, w.name)
            new_inputs = []
            for part, t in parts.items():
                v = ir.Value(name=t.name, shape=t.shape, type=ir.TensorType(t.dtype), const_value=t)
                model.graph.register_initializer(v)
                new_inputs.append(v)
            attrs = {"K": k, "N": n, "bits": opts.bits, "block_size": opts.block_size}
            if opts.accuracy_level:
                attrs["accuracy_level"] = opts.accuracy_level
            new = ir.Node("com.microsoft", "MatMulNBits", [node.inputs[0], *new_inputs],
                          attributes=[ir.AttrInt64(a, attrs[a]) for a in sorted(attrs)],
                          name=f"{node.name}_Q{opts.bits}" if node.name else "")
            for old, out in zip(node.outputs, new.outputs):  # a graph output keeps its metadata, as in the proto
                out.metadata_props.update(old.metadata_props)
            ir.convenience.replace_nodes_and_values(model.graph, node, [node], [new], node.outputs, new.outputs)
            if not w.uses():
                inits.pop(w.name)
    model.opset_imports.setdefault("com.microsoft", 1)
    return model


def _run_quantizer(proto, q: QuantOptions, exclude: list[str]):
    """ONNX Runtime's MatMulNBitsQuantizer over a model proto, every MatMul but `exclude` (by node
    name) -> the quantized proto; its progress logging kept off stdout."""
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
    return quantizer.model.model


def set_aside(model, keep: set[str]) -> dict:
    """Every initializer of 1 KiB or more but those in `keep` -> a stand-in of its first row
    (a MoE target's routed experts: of one expert), the tensor itself kept aside with its bytes
    still in the float export's data files (experts under `export --quantize`: in the
    checkpoint); export/stream.py `put_back` gives them back after quantizing (an expert tensor
    that became QMoE's is quantized expert by expert as it is written). -> name: the tensor set aside."""
    aside = {}
    for value in model.graph.initializers.values():
        t = value.const_value
        if value.name in keep or t is None or not t.shape or t.nbytes < INLINE_BELOW:
            continue
        aside[value.name] = t
        value.const_value = stream.first_row_zeros(t)
    return aside


def pack_blocks(w_in_out: np.ndarray, q: QuantOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A [K, N] weight -> (packed uint8 [N, blocks, blob], scales [N, blocks], zero points or None):
    ONNX Runtime's own C++ blockwise quantizer, the one MatMulNBitsQuantizer calls, so a table
    quantized here has the bytes a MatMulNBits head of the same weight has."""
    k, n = w_in_out.shape
    if k % q.block_size:
        raise DFlashError(f"--quantize-embedding: hidden size {k} is not a multiple of --quant-block-size {q.block_size}")
    blocks = k // q.block_size
    w = np.ascontiguousarray(w_in_out)
    packed = np.zeros((n, blocks, q.block_size * q.bits // 8), np.uint8)
    scales = np.zeros((n, blocks), w.dtype)
    zp = np.zeros((n, (blocks * q.bits + 7) // 8), np.uint8)
    fn = ort_pybind.quantize_matmul_4bits if q.bits == 4 else ort_pybind.quantize_matmul_8bits
    fn(packed, w, scales, zp, q.block_size, n, k, q.symmetric)
    return packed, scales, None if q.symmetric else zp


def quantize_embedding(model, q: QuantOptions) -> bool:
    """Gather(embed_tokens.weight, ids) -> com.microsoft::GatherBlockQuantized(table_Qn, ids, scales[, zp])
    (uint8 data, `bits` packed low bits first along the hidden axis, zero point 2^(bits-1) when
    symmetric: MatMulNBits' own convention, checked against it in tests/test_quantize.py).
    False when the graph has no lookup of the table."""
    embed = C.SHARED_INITIALIZERS[0]
    value = model.graph.initializers.get(embed)
    gathers = [node for node, _ in value.uses() if node.op_type == "Gather"] if value is not None else []
    if not gathers:
        return False
    table = value.const_value.numpy()
    if table.dtype not in (np.float32, np.float16):
        raise DFlashError(f"--quantize-embedding: the table is {table.dtype}; export with --dtype fp32 or fp16")
    packed, scales, zp = pack_blocks(table.T, q)
    vocab, hidden = table.shape
    del table
    inputs = {f"{embed}_Q{q.bits}": packed.reshape(vocab, hidden * q.bits // 8), f"{embed}_scales": scales}
    if zp is not None:
        inputs[f"{embed}_zero_points"] = zp
    values = {}
    for name, arr in inputs.items():
        values[name] = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                                const_value=ir.Tensor(arr, name=name))
        model.graph.register_initializer(values[name])
    data, scale, *zero = values.values()
    for node in gathers:
        axis = node.attributes.get("axis")
        if (axis.value if axis is not None else 0) != 0:
            raise DFlashError(f"--quantize-embedding: {node.name} gathers along axis {axis.value}, not the vocabulary")
        new = ir.Node("com.microsoft", "GatherBlockQuantized", [data, node.inputs[1], scale, *zero],
                      attributes=[ir.AttrInt64("gather_axis", 0), ir.AttrInt64("quantize_axis", 1),
                                  ir.AttrInt64("block_size", q.block_size), ir.AttrInt64("bits", q.bits)],
                      name=f"{node.name or 'embed'}_quantized")
        ir.convenience.replace_nodes_and_values(model.graph, node, [node], [new], node.outputs, new.outputs)
    if not value.uses():
        model.graph.initializers.pop(embed)
    model.opset_imports.setdefault("com.microsoft", 1)
    return True


def quantize_artifact(src, out, q: QuantOptions, *, force: bool = False, progress: bool = True,
                      experts: dict | None = None, started: float | None = None,
                      streamed: dict | None = None) -> M.Manifest:
    """A float artifact directory (`export` output) -> a weight-only quantized one at `out`.

    Graphs are read with their external data mapped, quantized one at a time and written
    like the export writes them (shared tensors once in shared.data, the rest as external
    data of their graph), validated, their accuracy level set (measured unless given) and
    described in a new manifest. Atomic like `export`.

    experts: `export --quantize` of a MoE target whose experts stream from the checkpoint: its
    float export holds one-expert stand-ins (export/stream.py `stand_ins`), and these (name ->
    StreamedExperts) take their place, so each expert is read from the checkpoint as its
    quantized form is written. started: when the run began (perf_counter), for the time the
    final table reports (`export --quantize`: its export's start, not the quantization's).
    streamed: `export --quantize` of a pair whose every weight streams (export/stream.py
    `stand_ins_all`): graph -> {name: StreamedWeight} given back the same way.
    """
    src, out = Path(src), Path(out).absolute()
    m = M.load_manifest(src, verify=True)
    if m.quantization is not None:
        raise DFlashError(f"{src} is already quantized ({m.quantization['scheme']}); quantize its float export "
                          "(or re-export from the checkpoints with --quantize)")
    check_options(q, m.dtype)
    if q.block_size is None:
        q = dataclasses.replace(q, block_size=default_block_size(q.scheme, m.hidden_size, (m.moe or {}).get("expert_size")))
    check_out_dir(out, force)
    ui = Phases(progress)
    t0 = time.perf_counter() if started is None else started
    embed, head = C.SHARED_INITIALIZERS
    quantized: dict[str, list[str]] = {}
    # export --quantize: its own export's staging is `partial`; this one is removed unless published, Ctrl-C too
    with staged(out, "partial-q", say=ui.console.print) as tmp:
        extra = " + LM head" if q.lm_head else ""
        extra += " + embedding" if q.embedding else ""
        extra += f" (at {q.head().bits} bits)" if extra and q.head() is not q else ""
        with ui.phase("quantize", f"{q.scheme}, block {q.block_size}, {'symmetric' if q.symmetric else 'asymmetric'}: "
                                  f"{', '.join(q.graphs())}{extra} (onnxruntime)") as bar:
            models, tied = {}, False
            for name, f in C.GRAPH_FILES.items():
                model = ir.load(src / f)  # external data stays on disk until a tensor is read
                inits = model.graph.initializers
                if name == C.TARGET and experts:
                    stream.restore(model, experts)
                if streamed:
                    stream.restore(model, streamed[name])
                if name == C.TARGET:
                    tied = head in inits and embed in inits and _same_bytes(inits[head], inits[embed])
                    if tied and q.embedding and not q.lm_head:
                        raise DFlashError("--quantize-embedding on tied embeddings needs --quantize-lm-head too: the "
                                          "float head reads the table's own bytes, so a quantized lookup would add a copy")
                # a tied head keeps the table's bytes unless quantized: then it needs its own [in, out] layout
                store_transposed(model, keep=(head,) if tied and not q.quantizes(name, head) else ())
                if name in q.graphs() or (head in inits and q.quantizes(name, head)):
                    model, quantized[name] = quantize_graph(model, q, name)
                    if not quantized[name]:
                        raise DFlashError(f"{f} has no linear layer with a constant weight to quantize")
                if q.embedding and quantize_embedding(model, q.head()):
                    quantized.setdefault(name, []).append(embed)
                models[name] = model
            # shared: the embedding, and what several graphs hold with the same bytes (a quantized
            # head, the drafter's K/V projections); quantization is deterministic, so they match
            shared = save_graphs(tmp, models, aliases(models[C.TARGET], q, tied), bar)
            del models
            even_rows.pad_file(tmp / C.GRAPH_FILES[C.TARGET])  # a row's logits alike alone and in a block
            for name in C.TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, tmp / name)
        with ui.phase("validate", "onnx.checker, shape inference, op lint, ORT load"):
            validate_artifact(tmp, m.dtype, quantized=tuple(quantized), attention=m.attention, moe=(m.moe or {}).get("path"))
        specs = {name: graph_spec(tmp / f) for name, f in C.GRAPH_FILES.items()}
        manifest = dataclasses.replace(m, graphs=specs, files={}, engines=None, shared=shared,
                                       quantization=q.record(quantized, {}, (m.moe or {}).get("path")))
        level = {"accuracy_level": q.accuracy_level, "accuracy_level_from": "flag"}
        if q.accuracy_level is None and not q.target:  # nothing the output depends on to measure: the fast kernel
            level = {"accuracy_level": DRAFT_ONLY_LEVEL, "accuracy_level_from": "draft-only default"}
        elif q.accuracy_level is None and streamed and not AL.fits(streamed[C.TARGET], tmp):
            level = AL.unprobed(streamed[C.TARGET])
        elif q.accuracy_level is None:
            with ui.phase("accuracy level", "MatMulNBits at levels 0 and 4: step time and logits vs a float reference"):
                write_manifest_checked(tmp, manifest)  # the probe opens the directory like any reader
                level = AL.choose(tmp, src, manifest, floats=streamed[C.TARGET] if streamed else None)
        AL.set_level(tmp, level["accuracy_level"])
        manifest = dataclasses.replace(manifest, quantization=q.record(quantized, level, (m.moe or {}).get("path")))
        write_manifest_checked(tmp, manifest)
        commit(tmp, out)
    report(ui, out, time.perf_counter() - t0)
    return manifest


def aliases(target, q: QuantOptions, tied: bool) -> dict[str, str]:
    """Shared tensors stored as the bytes of another (name -> that name): a tied float head is
    the table; a quantized tied head and the quantized table are the same packed bytes."""
    embed, head = C.SHARED_INITIALIZERS
    if not tied:
        return {}
    if not q.quantizes(C.TARGET, head):  # the target's float head reads the table
        return {head: embed}
    inits = target.graph.initializers
    out = {}
    for suffix in (f"_Q{q.head().bits}", "_scales", "_zero_points"):
        a, b = inits.get(embed + suffix), inits.get(head + suffix)
        if a is not None and b is not None and np.array_equal(a.const_value.numpy().ravel(), b.const_value.numpy().ravel()):
            out[a.name] = b.name
    return out


def _same_bytes(a, b) -> bool:
    """Two initializers stored at the same place of the same external file (tied weights)."""
    ta, tb = a.const_value, b.const_value
    if isinstance(ta, stream.StreamedWeight) and isinstance(tb, stream.StreamedWeight):  # from the checkpoint
        return ta.entry == tb.entry and ta.transposed_ == tb.transposed_
    where = lambda t: (getattr(t, "location", None), getattr(t, "offset", None))  # noqa: E731
    return where(ta) == where(tb) and where(ta)[0] is not None


def dequantize(node, arrays: dict) -> np.ndarray:
    """A MatMulNBits node's weight as the float [N, K] matrix it multiplies by (x @ W.T), or a
    GatherBlockQuantized node's table [vocab, hidden], from its packed inputs, per ONNX
    Runtime's contrib-op spec: uint8 [N, blocks, blob] (4 bits: two values a byte, low nibble
    first), scales [N, blocks], zero points packed the same way (absent: 2^(bits-1)); the
    lookup's data is the same bytes as [N, K * bits / 8]. Written here, not taken from ORT, so
    that `check` compares the graphs with an independent reading of their weights."""
    attr = {a.name: a.i for a in node.attribute}
    ins = list(node.input) + [""] * 4
    if node.op_type == "GatherBlockQuantized":
        if (attr.get("gather_axis", 0), attr.get("quantize_axis", 1)) != (0, 1):
            raise DFlashError(f"GatherBlockQuantized {node.name}: axes other than gather 0 / quantize 1 are not produced here")
        data, zp_name = arrays[ins[0]], ins[3]
        bits, bs = attr.get("bits", 4), attr["block_size"]
        n, k = data.shape[0], data.shape[1] * 8 // bits
    else:
        data, zp_name = arrays[ins[1]], ins[3]
        n, k, bits, bs = attr["N"], attr["K"], attr["bits"], attr["block_size"]
    scales = arrays[ins[2]].astype(np.float32).reshape(n, -1)
    blocks = scales.shape[1]
    if bits == 4:
        b = data.reshape(n, -1)
        q = np.stack([b & 0x0F, b >> 4], -1).reshape(n, blocks, bs)
    elif bits == 8:
        q = data.reshape(n, blocks, bs)
    else:
        raise DFlashError(f"{node.op_type} {node.name}: {bits} bits is not int4 or int8")
    if zp_name:
        zp = arrays[zp_name]
        if zp.dtype != np.uint8:
            raise DFlashError(f"{node.op_type} {node.name}: float zero points are not produced by this exporter")
        zp = zp.reshape(n, -1)
        if bits == 4:
            zp = np.stack([zp & 0x0F, zp >> 4], -1).reshape(n, -1)
        zp = zp[:, :blocks].astype(np.float32)
    else:
        zp = np.full((n, blocks), 2.0 ** (bits - 1), np.float32)
    w = (q.astype(np.float32) - zp[..., None]) * scales[..., None]
    return w.reshape(n, blocks * bs)[:, :k]


QUANTIZED_NODES = ("MatMulNBits", "GatherBlockQuantized")


def dequantized_weights(root) -> dict[str, dict[str, np.ndarray]]:
    """graph -> {float weight name: [N, K] float32} for every MatMulNBits (and the lookup table
    of a GatherBlockQuantized) of a quantized artifact, and [E, N, K] for the experts of each QMoE
    or gathered as codes (--moe standard)."""
    out = {}
    for graph, parts in dequantizers(root).items():
        out[graph] = {}
        for part in dict.fromkeys(parts.values()):  # a QMoE node gives two names at once
            out[graph].update(part())
    return out


def dequantizers(root) -> dict[str, dict]:
    """graph -> {float weight name: a function returning {name: float32 array}} (one function per
    node: a QMoE's gives both of its experts' tensors): what dequantized_weights computes, read and
    dequantized only when called (check's layer-at-a-time reference, export/layerwise.py)."""
    out = {}
    for graph, f in C.GRAPH_FILES.items():
        model = onnx.load(str(Path(root) / f), load_external_data=False)
        nodes = [n for n in model.graph.node if n.op_type in QUANTIZED_NODES]
        experts = [n for n in model.graph.node if n.op_type == "QMoE"]
        gathered = moe.gathered_parts(model)  # --moe standard: experts gathered as codes
        if not nodes and not experts and not gathered:
            continue
        read = lambda names, model=model: read_initializers(Path(root), model, set(names))  # noqa: E731
        weight = lambda n: (n.input[0] if n.op_type == "GatherBlockQuantized" else n.input[1]).rsplit("_Q", 1)[0]  # noqa: E731
        parts = out[graph] = {}
        for n in nodes:
            parts[weight(n)] = lambda n=n, read=read: {weight(n): dequantize(n, read([i for i in n.input if i]))}
        for n in experts:  # {fc1: gate_up_proj, fc2: down_proj}, named after their codes (moe.dequantize_qmoe)
            part = lambda n=n, read=read: moe.dequantize_qmoe(n, read([i for i in n.input if i]))  # noqa: E731
            for codes in (n.input[2], n.input[5]):
                parts[codes.rsplit("_Q", 1)[0]] = part
        for name, codes, scales, zp, bits in gathered:
            def part(name=name, codes=codes, scales=scales, zp=zp, bits=bits, read=read):
                a = read([codes, scales, zp] if zp else [codes, scales])
                return {name: moe.dequantize_experts(a[codes], a[scales], a[zp] if zp else None, bits)}
            parts[name] = part
    return out


def dequantized_sources(root: Path, target, drafter):
    """Copies of the PyTorch modules holding the weights the quantized graphs multiply by, or
    (None, why) when a quantized weight is not a parameter of the source."""
    qt, qd = copy.deepcopy(target), copy.deepcopy(drafter)
    embed, head = C.SHARED_INITIALIZERS
    weights_of = dequantized_weights(root)
    for block in moe_blocks.blocks(qt):  # the graph's experts are folded (Gemma 4's per-expert scale: export/moe.py)
        if hasattr(block, "fold"):
            block.fold()
    for graph, weights in weights_of.items():
        module = qt if graph == C.TARGET else qd
        for name, w in weights.items():
            # one head and one table for both graphs; a tied pair is untied: each reads its own rounding
            if name == head and graph != C.TARGET and head not in weights_of.get(C.TARGET, {}):
                qd.vocab_head = torch.from_numpy(w).to(qt.lm_head.weight.dtype)  # --draft-only: the drafter's own head
                continue
            if name in (head, embed):
                owner = qt.lm_head if name == head else qt.model.embed_tokens
                p = owner.weight
                owner.weight = torch.nn.Parameter(torch.from_numpy(w).to(p.dtype), requires_grad=False)
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
