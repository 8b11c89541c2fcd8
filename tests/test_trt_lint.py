"""TensorRT compatibility lint (10.12 to 11.x): hand-built bad graphs fail by name; real exports pass."""

import json

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto as T
from onnx import helper
from runtime_cases import TRT_CASES, artifact

from dflash_export.cli import cli
from dflash_export.export.trt_lint import MIN_VERSION, OPS_FILE, check, lint_model, lint_range, max_opset
from dflash_export.runtime.errors import DFlashError


def model(nodes, inputs, outputs, inits=(), opset=17, domains=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(g, opset_imports=imports)


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def errors(m, graph="target", **kw):
    return [f.message for f in lint_model(m, graph, **kw) if f.level == "error"]


IDS = vi("input_ids", T.INT64, ["batch", "seq"])


def test_support_list_names_its_source():
    d = json.loads(OPS_FILE.read_text())
    assert d["source"]["repository"] == "https://github.com/onnx/onnx-tensorrt"
    assert d["source"]["file"] == "docs/operators.md" and d["source"]["release"].startswith("11.5 GA")
    assert "MatMul" in d["ops"] and "Unique" in d["unsupported"] and "Unique" not in d["ops"]
    assert not set(d["ops"]) & set(d["unsupported"])
    assert max_opset("10.12") == 20 and max_opset("10.15.1") == 24 and max_opset("11.0.0") == 24
    assert max_opset("11.5.0") == 25 and max_opset("11.9") == 25
    assert MIN_VERSION == "10.12" and lint_range() == "10.12 to 11.x"


def test_clean_graph_passes():
    n = [helper.make_node("Cast", ["input_ids"], ["f"], to=T.FLOAT), helper.make_node("Relu", ["f"], ["y"])]
    m = model(n, [IDS], [vi("y", T.FLOAT, ["batch", "seq"])])
    assert errors(m) == []


def test_unsupported_operator_is_named():
    n = [helper.make_node("Unique", ["input_ids"], ["y"])]
    m = model(n, [IDS], [vi("y", T.INT64, None)])
    (msg,) = errors(m)
    assert "operator Unique" in msg and "unsupported" in msg


def test_unknown_and_custom_domain_operators():
    n = [helper.make_node("FancyAttention", ["input_ids"], ["a"]),
         helper.make_node("GroupQueryAttention", ["a"], ["y"], domain="com.microsoft")]
    m = model(n, [IDS], [vi("y", T.INT64, None)], domains=["com.microsoft"])
    errs = errors(m)
    assert any("operator FancyAttention" in e and "not listed" in e for e in errs)
    assert any("com.microsoft::GroupQueryAttention" in e and "plugin" in e for e in errs)


def test_operators_added_in_11x():
    x = vi("input_ids", T.FLOAT, ["batch", "seq"])
    m = model([helper.make_node("Swish", ["input_ids"], ["y"])], [x], [vi("y", T.FLOAT, ["batch", "seq"])], opset=24)
    assert any("Swish" in e and ">= 11.0" in e for e in errors(m))  # default: lint for the oldest supported (10.12)
    assert any("opset 24 is outside TensorRT 10.12's range 9..20" in e for e in errors(m))
    assert errors(m, trt_version="11.0.0") == []
    m25 = model([helper.make_node("Relu", ["input_ids"], ["y"])], [x], [vi("y", T.FLOAT, None)], opset=25)
    assert any("opset 25" in e for e in errors(m25, trt_version="11.4")) and errors(m25, trt_version="11.5.0") == []


def test_operator_added_later_in_10x():
    x = vi("input_ids", T.FLOAT, ["batch", "seq"])
    scale = helper.make_tensor("scale", T.FLOAT, [1], [1.0])
    n = [helper.make_node("RMSNormalization", ["input_ids", "scale"], ["y"])]
    m = model(n, [x], [vi("y", T.FLOAT, ["batch", "seq"])], inits=[scale], opset=23)
    errs = errors(m, trt_version="10.0")
    assert any("RMSNormalization" in e and ">= 10.15" in e for e in errs)
    assert any("opset 23 is outside" in e for e in errs)
    assert errors(m, trt_version="10.15.1") == []


def test_unsupported_type_for_operator():
    a = vi("input_ids", T.INT32, ["batch", "seq"])
    w = helper.make_tensor("w", T.INT32, [1, 1], [2])
    m = model([helper.make_node("MatMul", ["input_ids", "w"], ["y"])], [a], [vi("y", T.INT32, None)], inits=[w])
    (msg,) = errors(m)
    assert "MatMul" in msg and "INT32" in msg


def test_axes_must_be_constant():
    x = vi("input_ids", T.FLOAT, ["batch", "seq"])
    axes = vi("axes", T.INT64, [1])
    m = model([helper.make_node("ReduceSum", ["input_ids", "axes"], ["y"])], [x, axes], [vi("y", T.FLOAT, None)], opset=18)
    assert any("ReduceSum" in e and "build-time constant" in e for e in errors(m))
    shape = helper.make_tensor("shape", T.INT64, [1], [1])
    a0 = helper.make_tensor("a0", T.INT64, [1, 1], [1])
    folded = [helper.make_node("Reshape", ["a0", "shape"], ["ax"]), helper.make_node("ReduceSum", ["input_ids", "ax"], ["y"])]
    m2 = model(folded, [x], [vi("y", T.FLOAT, None)], inits=[shape, a0], opset=18)
    found = lint_model(m2, "target")
    assert [f.level for f in found] == ["warning"] and "computed from constants" in found[0].message


def test_shapes_tensorrt_cannot_profile():
    unnamed = vi("input_ids", T.INT64, ["batch", None])
    m = model([helper.make_node("Identity", ["input_ids"], ["y"])], [unnamed], [vi("y", T.INT64, None)])
    assert any("dynamic without a name" in e for e in errors(m))
    odd = vi("past_key.0", T.FLOAT, ["batch", "past", "heads", 16])  # a dynamic axis no profile covers
    m = model([helper.make_node("Identity", ["past_key.0"], ["y"])], [odd], [vi("y", T.FLOAT, None)])
    assert any("past_key.0 axis 2 (kv_heads) must be static per the graph contract" in e for e in errors(m))


def test_block_dim_must_be_static_in_block_graph():
    dyn = vi("block_ids", T.INT64, ["batch", "block"])
    m = model([helper.make_node("Identity", ["block_ids"], ["y"])], [dyn], [vi("y", T.INT64, None)])
    assert any("block_ids axis 1 (block) must be static per the graph contract" in e for e in errors(m, "draft_block"))
    static = vi("block_ids", T.INT64, ["batch", 4])
    m = model([helper.make_node("Identity", ["block_ids"], ["y"])], [static], [vi("y", T.INT64, None)])
    assert errors(m, "draft_block") == []


# -- on real exports -------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(TRT_CASES))
def export(request):
    case = TRT_CASES[request.param]
    return artifact(case)[2], case.dtype, case.block, case.max_context


def test_lint_passes_on_exports(export):
    out, dtype, k, _ = export
    warnings = check(out)  # raises with the offending operator's name on any error
    assert all(w.level == "warning" for w in warnings)
    block = onnx.load(str(out / "draft_block.onnx"), load_external_data=False)
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in block.graph.input}
    assert dims["block_ids"][1] == k  # static block dim, checked by the lint too


def test_lint_fails_when_export_gets_unsupported_op(export, tmp_path):
    out, *_ = export
    m = onnx.load(str(out / "draft_context.onnx"), load_external_data=False)
    node = next(n for n in m.graph.node if n.op_type == "MatMul")
    node.op_type = "MatMulInteger"  # what a quantizer might leave behind
    (bad,) = [f for f in lint_model(m, "draft_context") if f.level == "error"]
    assert "operator MatMulInteger" in bad.message


def test_build_dry_run_lints_and_prints_plan(export):
    out, dtype, k, mc = export
    files = sorted(p.name for p in out.iterdir())
    r = CliRunner().invoke(cli, ["build", str(out), "--dry-run", "--max-prompt", "16"])
    assert r.exit_code == 0, r.output
    assert "lint: every graph passes the TensorRT 10.12 to 11.x checks" in r.output
    assert f"block {k}, max context {mc}, max prompt 16" in r.output  # the export's max context by default
    assert f"seq 1..{k}" in r.output and f"past_ctx 1..{mc - 1}" in r.output  # verify: any prefix of the block
    assert sorted(p.name for p in out.iterdir()) == files  # nothing written
    r = CliRunner().invoke(cli, ["build", str(out), "--dry-run", "--max-prompt", str(mc)])  # no room for a block
    assert r.exit_code == 2 and f"error: --max-prompt {mc}" in r.output


def test_check_raises_one_line_naming_the_operator(tmp_path):
    from dflash_export.runtime.manifest import GraphSpec, Manifest, TensorSpec

    m = model([helper.make_node("Unique", ["input_ids"], ["y"])], [IDS], [vi("y", T.INT64, None)])
    onnx.save(m, str(tmp_path / "target.onnx"))
    man = Manifest(block_size=4, mask_token_id=0, target_layer_ids=[0], dtype="fp32", vocab_size=10, max_context=64,
                   hidden_size=8, target_layers=0, target_kv_heads=1, target_head_dim=8, draft_layers=1,
                   draft_kv_heads=1, draft_head_dim=8, architecture="qwen3", eos_token_ids=[1], opset=17,
                   graphs={"target": GraphSpec("target.onnx", [TensorSpec("input_ids", "int64", ["batch", "seq"])], [])},
                   tools={})
    with pytest.raises(DFlashError) as e:
        check(tmp_path, man)
    assert "operator Unique" in str(e.value) and "\n" not in str(e.value)
