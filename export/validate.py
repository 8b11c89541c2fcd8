"""Validation of exported graphs: onnx.checker, shape inference, a portability lint, ORT load.

The lint keeps the graphs to standard ai.onnx operators: no com.microsoft or custom
domains, no leftover onnxscript functions, so every ORT execution provider and TensorRT's
ONNX parser take them as they are. The exceptions are asked for: a quantized export's
MatMulNBits, and the "ort" attention flavour's com.microsoft GroupQueryAttention and
SkipSimplifiedLayerNormalization in the target graph (export --attention ort).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from ..runtime import contract as C
from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import
from .ops import MOE_OPS, ORT_FLAVOUR_OPS, QMOE_OPS, QUANT_OPS, STANDARD_DOMAINS, register_ort_schemas

onnx = lazy_import("onnx")  # on first use (runtime/lazy.py)
ort = lazy_import("onnxruntime")


def lint(model, allowed: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """Problems that would tie a graph to one runtime; [] when it is portable.

    allowed: (domain, op) pairs accepted anyway (a quantized export's MatMulNBits)."""
    problems = []
    domains = {d for d, _ in allowed}
    for fn in model.functions:
        problems.append(f"local function {fn.domain}::{fn.name}")
    for imp in model.opset_import:
        if imp.domain not in STANDARD_DOMAINS and imp.domain not in domains:
            problems.append(f"opset import of domain {imp.domain!r}")
    seen = set(allowed)
    for node in _nodes(model.graph):
        if node.domain not in STANDARD_DOMAINS and (node.domain, node.op_type) not in seen:
            seen.add((node.domain, node.op_type))
            problems.append(f"operator {node.domain}::{node.op_type}")
    return problems


def _nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:  # subgraphs (If/Loop/Scan bodies)
            if attr.g.node:
                yield from _nodes(attr.g)
            for g in attr.graphs:
                yield from _nodes(g)


def check_graph(path: Path, allowed: tuple[tuple[str, str], ...] = ()) -> None:
    """onnx.checker with full (strict) shape inference, on the path so external data is read."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:  # checker and inference raise several types
        raise DFlashError(f"{path.name} fails onnx.checker/shape inference: {str(e).strip().splitlines()[0]}") from e
    problems = lint(onnx.load(str(path), load_external_data=False), allowed)
    if problems:
        raise DFlashError(f"{path.name} uses non-standard ONNX: {'; '.join(problems)}")


def ort_session(path: Path, providers=("CPUExecutionProvider",), load_only: bool = False):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if load_only:  # no folded or prepacked weight copies: a load check should not double the memory
        opts.add_session_config_entry("session.disable_prepacking", "1")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=list(providers))


def validate_artifact(root: Path, dtype: str = "fp32", quantized: Collection[str] = (), attention: str = "standard",
                      moe: str | None = None) -> None:
    """Every graph passes the checker and the lint and loads in ONNX Runtime (CPU).

    quantized: the graphs whose lint accepts ONNX Runtime's MatMulNBits (export/quantize.py), by
    name: --draft-only leaves the target float; attention "ort": the target may hold
    GroupQueryAttention (export --attention ort); moe "op": the target may hold
    com.microsoft::MoE (export --moe op), QMoE once it is quantized; nothing else."""
    if attention == "ort" or moe == "op":
        register_ort_schemas()
    for g, f in C.GRAPH_FILES.items():
        ort_ops = ORT_FLAVOUR_OPS if g == C.TARGET and attention == "ort" else ()
        ort_ops += (QMOE_OPS if g in quantized else MOE_OPS) if g == C.TARGET and moe == "op" else ()
        check_graph(root / f, (QUANT_OPS if g in quantized else ()) + ort_ops)
    for f in C.GRAPH_FILES.values():
        try:
            sess = ort_session(root / f, load_only=True)
        except Exception as e:
            if dtype == "bf16" and "NOT_IMPLEMENTED" in str(e):
                continue  # ORT's CPU provider lacks bf16 kernels; GPU providers run these graphs
            raise DFlashError(f"ONNX Runtime cannot load {f}: {str(e).strip().splitlines()[0]}") from e
        del sess
