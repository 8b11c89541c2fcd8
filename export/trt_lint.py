"""Will TensorRT's ONNX parser take these graphs? Checked without TensorRT, for 10.12 to 11.x.

Building an engine is the only full proof, and it needs TensorRT and a GPU. What can be
checked from the ONNX files alone is checked here, before any build:

- every operator is in onnx-tensorrt's support list (trt_ops.json: the 11.5 GA list, with
  the release that added each newer op), in the standard ONNX domain, within the opsets of
  the TensorRT linted for (by default the oldest supported, 10.12: what passes there passes
  on every supported release, as no 11.x release removed an operator);
- every tensor's data type is one the operator supports there (the Supported Types column,
  applied to each node's inputs and to the outputs of type-creating ops such as Cast);
- inputs the parser needs as build-time constants are constants (Reduce axes, ...);
- every graph input is the graph contract's (runtime/contract.py), each dim with its role
  there: dynamic roles named and covered by a TensorRT optimization profile
  (runtime/profiles.py), static ones (the block size K, heads, ...) fixed at the
  manifest's size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import onnx

from ..runtime import contract as C
from ..runtime.contract import GRAPH_FILES
from ..runtime.manifest import Manifest, load_manifest
from ..runtime.errors import DFlashError
from ..runtime.profiles import axis_role, profiles, resolve_limits
from ..runtime.trt.engines import TRT_BELOW, TRT_MIN, refuse_quantized

OPS_FILE = Path(__file__).with_name("trt_ops.json")
ORT_FLAVOUR = ("exported with --attention ort (com.microsoft GroupQueryAttention, ONNX Runtime only): TensorRT "
               "accepts the standard flavour only; re-export with --attention standard")
MOE_OP = ("exported with --moe op (com.microsoft::MoE, ONNX Runtime only): TensorRT builds the experts in standard "
          "ops only; re-export with --moe standard")
MIN_VERSION = ".".join(map(str, TRT_MIN))  # lint for the whole supported range unless told the exact version
TYPE_NAMES = {
    onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.FLOAT16: "FP16", onnx.TensorProto.BFLOAT16: "BF16",
    onnx.TensorProto.INT32: "INT32", onnx.TensorProto.INT64: "INT64", onnx.TensorProto.INT8: "INT8",
    onnx.TensorProto.UINT8: "UINT8", onnx.TensorProto.BOOL: "BOOL", onnx.TensorProto.DOUBLE: "DOUBLE",
    onnx.TensorProto.INT4: "INT4", onnx.TensorProto.FLOAT8E4M3FN: "FP8",
}
if hasattr(onnx.TensorProto, "FLOAT4E2M1"):
    TYPE_NAMES[onnx.TensorProto.FLOAT4E2M1] = "FP4"
# ops whose outputs carry a type not taken from an input: their outputs are checked too
TYPE_SOURCES = {"Constant", "ConstantOfShape", "Cast", "CastLike", "EyeLike", "RandomNormal", "RandomUniform",
                "RandomNormalLike", "RandomUniformLike"}


@dataclass
class Finding:
    graph: str
    level: str  # "error" | "warning"
    message: str

    def __str__(self) -> str:
        return f"{self.graph}: {self.message}"


def lint_range() -> str:
    """The TensorRT releases the default lint speaks for, e.g. "10.12 to 11.x"."""
    return f"{MIN_VERSION} to {TRT_BELOW[0] - 1}.x"


@lru_cache(maxsize=1)
def support_list() -> dict:
    return json.loads(OPS_FILE.read_text())


def _ver(v: str) -> tuple[int, int]:
    parts = (str(v).split(".") + ["0"])[:2]
    return int(parts[0]), int(parts[1])


def max_opset(trt_version: str) -> int:
    """Highest opset documented for this release (the newest listed release not after it)."""
    table = support_list()["opset_max"]
    known = [r for r in table if _ver(r) <= _ver(trt_version)]
    return table[max(known, key=_ver)] if known else table[min(table, key=_ver)]


def _type_name(elem: int) -> str:
    return TYPE_NAMES.get(elem, onnx.TensorProto.DataType.Name(elem) if elem else "UNKNOWN")


def _nodes(graph: onnx.GraphProto):
    """Every node, including those inside If/Loop/Scan bodies."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _nodes(g)


def _types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor name we can see (after ONNX shape inference)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - inference is best effort; declared types still count
        inferred = model
    out: dict[str, int] = {}

    def visit(g: onnx.GraphProto) -> None:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type"):
                out[vi.name] = vi.type.tensor_type.elem_type
        for init in g.initializer:
            out[init.name] = init.data_type
        for node in g.node:
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                        out[node.output[0]] = a.t.data_type
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        visit(sub)

    visit(inferred.graph)
    return out


def _constants(graph: onnx.GraphProto) -> tuple[set[str], set[str]]:
    """(constants, foldable): initializers and Constant outputs; and tensors computed only
    from constants (e.g. a Reshape of an initializer), which a constant-folding pass turns
    into initializers but which TensorRT's parser may not take where it wants one."""
    consts = {i.name for i in graph.initializer}
    for node in _nodes(graph):
        if node.op_type == "Constant":
            consts.update(node.output)
    foldable = set(consts)
    for node in graph.node:  # ONNX nodes are topologically sorted
        ins = [i for i in node.input if i]
        if ins and all(i in foldable for i in ins) and not node.op_type.startswith("Random") \
                and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            foldable.update(node.output)
    return consts, foldable - consts


def lint_model(model: onnx.ModelProto, graph: str, manifest: Manifest | None = None,
               trt_version: str = MIN_VERSION, limits=None) -> list[Finding]:
    """All findings for one graph (`graph` is target / draft_context / draft_block): its opsets, its
    operators, its inputs."""
    sup = support_list()
    checks = (_opset_findings(model, sup, trt_version), _operator_findings(model, sup, trt_version),
              _input_findings(model, graph, sup, manifest, limits))
    return [Finding(graph, level, message) for check in checks for level, message in check]


# -- lint_model's checks: each yields (level, message) -------------------------------------


def _opset_findings(model: onnx.ModelProto, sup: dict, trt_version: str):
    """The default domain's opset inside the range this TensorRT version parses."""
    hi = max_opset(trt_version)
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            if not sup["opset_min"] <= imp.version <= hi:
                yield "error", (f"opset {imp.version} is outside TensorRT {trt_version}'s range {sup['opset_min']}..{hi}; "
                                f"re-export with --opset {min(max(imp.version, sup['opset_min']), hi)}")


def _operator_findings(model: onnx.ModelProto, sup: dict, trt_version: str):
    """Every node's operator against the support list (trt_ops.json): known and old enough (once per
    operator), then its constant inputs, attributes and types."""
    ops, unsupported = sup["ops"], set(sup["unsupported"])
    consts, foldable = _constants(model.graph)
    folded_warned: set[str] = set()
    types = _types(model)
    seen_bad: set[str] = set()
    for node in _nodes(model.graph):
        op, where = node.op_type, f"node {node.name!r}" if node.name else "a node"
        if node.domain not in ("", "ai.onnx"):
            if op not in seen_bad:
                yield "error", (f"operator {node.domain}::{op} ({where}) is not a standard ONNX operator; TensorRT's "
                                "parser would need a plugin for it")
                seen_bad.add(op)
            continue
        entry = ops.get(op)
        if entry is None:
            if op not in seen_bad:
                why = "marked unsupported" if op in unsupported else "not listed"
                yield "error", f"operator {op} ({where}) is {why} in TensorRT's ONNX operator support list (trt_ops.json)"
                seen_bad.add(op)
            continue
        if "since" in entry and _ver(entry["since"]) > _ver(trt_version):
            if op not in seen_bad:
                yield "error", f"operator {op} ({where}) needs TensorRT >= {entry['since']} (linting for {trt_version})"
                seen_bad.add(op)
        yield from _constant_inputs(node, where, entry, consts, foldable, folded_warned)
        yield from _attributes(node, where, entry)
        yield from _types_taken(node, where, entry, types)


def _constant_inputs(node, where: str, entry: dict, consts: set[str], foldable: set[str], folded_warned: set[str]):
    """The inputs TensorRT needs as build-time constants: initializers (computed from constants: a warning,
    once per operator)."""
    op = node.op_type
    for idx in entry.get("const_inputs", []):
        name = node.input[idx] if idx < len(node.input) else ""
        if not name or name in consts:
            continue
        if name in foldable:
            if op not in folded_warned:
                yield "warning", (f"{op} input {idx} ({name!r}, {where}) is computed from constants, not an initializer "
                                  "as TensorRT's parser documents; if the parse rejects it, constant-fold the graphs first")
                folded_warned.add(op)
        else:
            yield "error", f"operator {op} ({where}): input {idx} ({name!r}) must be a build-time constant for TensorRT"


def _attributes(node, where: str, entry: dict):
    """Attributes whose value TensorRT fixes (e.g. a mode it implements alone)."""
    op = node.op_type
    for name, want in entry.get("attr_equals", {}).items():
        for a in node.attribute:
            if a.name == name:
                got = onnx.helper.get_attribute_value(a)
                got = got.decode() if isinstance(got, bytes) else got
                if got != want:
                    yield "error", f"operator {op} ({where}): attribute {name}={got!r} is unsupported (TensorRT needs {want!r})"


def _types_taken(node, where: str, entry: dict, types: dict[str, int]):
    """The element types of the node's inputs (and of what a type source makes) among the operator's
    supported ones; DOUBLE is a warning (cast down); one type error per node."""
    op = node.op_type
    allowed = set(entry["types"])
    checked = list(node.input) + (list(node.output) if op in TYPE_SOURCES else [])
    for t in checked:
        if not t or t not in types or not types[t]:
            continue
        tn = _type_name(types[t])
        if tn == "DOUBLE":
            yield "warning", f"{t!r} ({op}, {where}) is DOUBLE: TensorRT casts it down to FP32"
        elif tn not in allowed:
            yield "error", f"operator {op} ({where}) gets {tn} on {t!r}; TensorRT supports {op} on {', '.join(entry['types'])}"
            break  # one type error per node is enough


def _input_findings(model: onnx.ModelProto, graph: str, sup: dict, manifest: Manifest | None, limits):
    """Graph inputs: types TensorRT takes, static dims, or named dynamic dims a profile covers, and the
    graph contract's names (runtime/contract.py gives every input axis its role: dynamic roles need a
    named dim and a profile range, static ones a fixed size, the manifest's if given)."""
    init_names = {i.name for i in model.graph.initializer}
    covered = set()
    if manifest is not None:
        lim = limits or resolve_limits(manifest)
        for p in profiles(lim).get(graph, []):
            covered |= set(p.ranges)
    static = C.sizes(manifest) if manifest is not None else {}
    expected = C.names(graph, manifest)[0] if manifest is not None else []
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        tn = _type_name(vi.type.tensor_type.elem_type)
        if tn not in sup["data_types"] or tn in sup["quantized_only_types"]:
            yield "error", f"input {vi.name} has type {tn}, which TensorRT cannot take as a network input"
        dims = vi.type.tensor_type.shape.dim if vi.type.tensor_type.HasField("shape") else None
        if dims is None:
            yield "error", f"input {vi.name} has no shape; TensorRT needs the rank and a profile for each dynamic dim"
            continue
        for axis, d in enumerate(dims):
            problem = _axis_problem(graph, vi.name, axis, d, manifest, covered, static)
            if problem:
                yield "error", problem
        if expected and vi.name not in expected:
            yield "error", f"input {vi.name} is not an input of {graph} in the graph contract; re-export the directory"
    names = {vi.name for vi in model.graph.input}
    for n in expected:
        if n not in names:
            yield "error", f"the graph contract lists input {n} but {graph}.onnx has no such input; re-export the directory"


def _axis_problem(graph: str, name: str, axis: int, d, manifest: Manifest | None, covered: set,
                  static: dict) -> str | None:
    """What is wrong with one input axis for TensorRT, by its role in the graph contract (None: nothing)."""
    role = axis_role(graph, name, axis, manifest)
    fixed = d.HasField("dim_value") and d.dim_value > 0
    if role in C.DYNAMIC:
        if fixed:
            return None
        if not d.dim_param:
            return f"input {name} axis {axis} is dynamic without a name; TensorRT profiles need static or named dims"
        if manifest is not None and role not in covered:
            return f"input {name} axis {axis} ({d.dim_param!r}) has no range in the {graph} profiles"
        return None
    if role is not None and not fixed:
        return (f"input {name} axis {axis} ({role}) must be static per the graph contract, got {d.dim_param!r}; "
                "no TensorRT profile covers it")
    if role is not None and role in static and d.dim_value != static[role]:
        return f"input {name} axis {axis} ({role}) is {d.dim_value} but the manifest says {static[role]}"
    if role is None and not fixed:
        return f"input {name} axis {axis} is dynamic ({d.dim_param!r}) but no TensorRT profile covers that axis"
    return None


def lint_dir(out_dir: str | Path, manifest: Manifest | None = None, trt_version: str = MIN_VERSION,
             limits=None) -> list[Finding]:
    """Lint every graph of an exported directory (weights are not loaded)."""
    out_dir = Path(out_dir)
    manifest = manifest or load_manifest(out_dir)
    refuse_quantized(manifest)
    found = []
    if C.flavour(manifest) == "ort":  # the standard flavour is the only TensorRT input
        found.append(Finding(C.TARGET, "error", ORT_FLAVOUR))
    moe_op = (manifest.moe or {}).get("path") == "op"
    if moe_op:
        found.append(Finding(C.TARGET, "error", MOE_OP))
    for graph in manifest.graphs:
        if graph == C.TARGET and (C.flavour(manifest) == "ort" or moe_op):
            continue
        path = out_dir / GRAPH_FILES[graph]
        model = onnx.load(str(path), load_external_data=False)
        found += lint_model(model, graph, manifest, trt_version, limits)
    return found


def check(out_dir: str | Path, manifest: Manifest | None = None, trt_version: str = MIN_VERSION,
          limits=None) -> list[Finding]:
    """lint_dir, raising one DFlashError that names the first errors; returns the warnings."""
    found = lint_dir(out_dir, manifest, trt_version, limits)
    errors = [f for f in found if f.level == "error"]
    if errors:
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise DFlashError(f"TensorRT {trt_version} compatibility lint failed: "
                          + "; ".join(str(e) for e in errors[:3]) + more)
    return [f for f in found if f.level != "error"]
