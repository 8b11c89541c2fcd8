"""Tracing: the PyTorch graph wrappers -> ONNX IR with the contract's names, small IR passes.

torch.onnx.export (dynamo) traces each wrapper of export/graphs.py on inputs built from the
contract; the result is checked against runtime/contract.py, shape arithmetic is folded
and the initializers get stable names (the shared embedding and LM head, module paths).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings

import numpy as np

from ..runtime import contract as C, manifest as M
from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import

torch = lazy_import("torch")  # torch, onnx and the graphs: on first use (runtime/lazy.py)
optimizer = lazy_import("onnxscript.optimizer")
ir = lazy_import("onnx_ir")
graphs = lazy_import("dflash_export.export.graphs")
gqa = lazy_import("dflash_export.export.gqa")
moe = lazy_import("dflash_export.export.moe")


def trace(graph: str, module, m: M.Manifest, dtype, opset: int | None):
    """torch.onnx.export (dynamo) of one graph's wrapper -> onnx_ir.Model checked against the contract."""
    args, dynamic_shapes = graphs.trace_inputs(graph, m, dtype)
    extra, table = {}, {}
    if graph == C.TARGET and C.flavour(m) == "ort":
        table.update(gqa.TRANSLATION)
    if graph == C.TARGET and (getattr(m, "moe", None) or {}).get("path") == "op":
        table.update(moe.TRANSLATION)
    if table:
        extra["custom_translation_table"] = table
    inputs, outputs = C.names(graph, m)
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(
                module.eval(), args, dynamo=True, input_names=inputs, output_names=outputs,
                dynamic_shapes=dynamic_shapes, opset_version=opset, optimize=False, verbose=False, **extra,
            )
    except Exception as e:  # the exporter raises many types; report one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DFlashError(f"torch.onnx.export failed for {type(module).__name__}: {type(e).__name__}: {first}") from e
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    model = prog.model
    got = model.opset_imports.get("")
    if opset is not None and got != opset:
        raise DFlashError(f"--opset {opset}: the exporter could only produce opset {got} for this model; "
                          "use --opset 18 or higher (or leave it out)")
    check_io(graph, model, m)
    return model


def check_io(graph: str, model, m: M.Manifest) -> None:
    """The traced graph's inputs and outputs are the contract's: names, order, dtypes, static
    dims, and a named dynamic dim wherever the contract has a dynamic role."""
    ins, outs = C.io(graph, m)
    got = [v.name for v in (*model.graph.inputs, *model.graph.outputs)]
    want = [t.name for t in (*ins, *outs)]
    if got != want:
        raise DFlashError(f"exported {graph} has I/O {got}, expected {want}")
    static = C.sizes(m)
    for v, t in zip((*model.graph.inputs, *model.graph.outputs), (*ins, *outs)):
        dtype = v.dtype.numpy().name if v.dtype is not None else None
        if dtype != C.dtype(t, m):
            raise DFlashError(f"exported {graph}: {t.name} has dtype {dtype}, the contract says {C.dtype(t, m)}")
        dims = list(v.shape) if v.shape is not None else []
        for axis, (d, role) in enumerate(zip(dims, t.dims)):
            ok = not isinstance(d, int) if role in C.DYNAMIC else d == static[role]
            if len(dims) != len(t.dims) or not ok:
                raise DFlashError(f"exported {graph}: {t.name} has shape {dims}, the contract says {list(t.dims)}")


def fold_shape_constants(model) -> None:
    """Fold computations on constants (shape and axes arithmetic) but never touch a weight.

    The exporter leaves e.g. ReduceMean axes as Reshape(Constant, Constant); TensorRT's
    parser wants such inputs as initializers. onnxscript's full optimizer would also fold
    Transpose(weight) into new unnamed copies (for small weights only), which would break
    the shared embedding/LM head names, so any node that reads an initializer is skipped.
    """
    weights = set(model.graph.initializers)

    def should_fold(node):
        return False if any(v is not None and v.name in weights for v in node.inputs) else None

    optimizer.fold_constants(model, should_fold=should_fold)
    optimizer.remove_unused_nodes(model)


def rename_initializers(model, tied: bool) -> None:
    """Drop the wrapper prefix; the embedding and LM head get the SHARED_INITIALIZERS names.

    With tied embeddings torch.export keeps one parameter for both uses; it is split into
    two initializers, `embed_tokens.weight` (read by Gather) and `lm_head.weight` (read by
    the head's MatMul), that point at the same bytes of shared.data, so every graph that
    holds the shared tensors holds both names.
    """
    embed, head = C.SHARED_INITIALIZERS
    for value in list(model.graph.initializers.values()):
        prefix, _, rest = value.name.partition(".")
        name = rest if prefix in ("target", "drafter", "shared") and rest else value.name
        if name.endswith("embed_tokens.weight") or (tied and name.endswith("lm_head.weight")):
            name = embed
        elif name.endswith("lm_head.weight"):
            name = head
        value.name = name
    if tied and embed in model.graph.initializers and head not in model.graph.initializers:
        tied_value = model.graph.initializers[embed]
        head_uses = [(node, i) for node, i in tied_value.uses() if node.op_type != "Gather"]
        if not head_uses:  # a block graph with a reduced draft vocabulary reads the embedding only
            return
        head_value = ir.Value(name=head, shape=tied_value.shape, type=tied_value.type, const_value=tied_value.const_value)
        model.graph.register_initializer(head_value)
        for node, i in head_uses:
            node.replace_input_with(i, head_value)


def store_transposed(model, keep: tuple[str, ...] = ()) -> list[str]:
    """Store each linear weight in the layout its MatMul consumes: `MatMul(x, W^T)` with W^T
    an initializer under W's name, instead of `MatMul(x, Transpose(W))`.

    torch traces nn.Linear as MatMul(x, Transpose(W)); ONNX Runtime's weight-only quantizer
    (export/quantize.py) only quantizes a MatMul whose weight is a constant input, and ORT
    would otherwise fold a transposed copy of every weight at load. The transpose is done
    lazily, one tensor at a time, when the data file is written. `keep`: weights left as
    they are (the LM head of tied embeddings, whose bytes are the lookup table's). Returns
    the transposed names.
    """
    done = []
    for node in list(model.graph):
        w = node.inputs[0] if node.op_type == "Transpose" and node.inputs else None
        if w is None or w.name not in model.graph.initializers or w.name in keep or w.const_value is None:
            continue
        perm = node.attributes.get("perm")
        uses = list(node.outputs[0].uses())
        if perm is None or list(perm.as_ints()) != [1, 0] or len(list(w.uses())) != 1 or not uses \
                or any(u.node.op_type != "MatMul" or u.idx != 1 for u in uses):
            continue
        t = w.const_value
        shape = ir.Shape([t.shape[1], t.shape[0]])
        w.const_value = ir.LazyTensor(
            lambda t=t: ir.Tensor(np.ascontiguousarray(t.numpy().T), dtype=t.dtype), dtype=t.dtype, shape=shape
        )
        w.shape = shape
        node.outputs[0].replace_all_uses_with(w)
        model.graph.remove(node, safe=True)
        done.append(w.name)
    return done
