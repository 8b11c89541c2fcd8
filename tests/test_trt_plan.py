"""TensorRT build plan, profiles, ORT TensorRT-provider options, engine checks: no TensorRT needed."""

import subprocess
import sys

import pytest

from dflash_export.export.trt_build import build_plan, describe
from dflash_export.runtime.manifest import GraphSpec, Manifest, TensorSpec
from dflash_export.runtime.errors import DFlashError, InternalError
from dflash_export.runtime.ort.trt_provider import default_cache_dir, ort_trt_provider_options
from dflash_export.runtime.profiles import Profile
from dflash_export.runtime.trt.engines import ENGINE_FILES, check_engine_record, check_trt_version

L, H, D, DL, DH, DD, TH, V = 2, 2, 16, 1, 2, 16, 96, 101


def manifest(k: int = 4, max_context: int = 64, dtype: str = "fp32") -> Manifest:
    """A manifest shaped like the exporter's (named dims batch/seq/past/ctx/past_ctx)."""
    f = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[dtype]
    t = lambda n, dt, s: TensorSpec(n, dt, s)  # noqa: E731
    kv = lambda p, n, past, h, d: [t(f"{p}_{kind}.{i}", f, ["batch", past, h, d]) for i in range(n) for kind in ("key", "value")]  # noqa: E731
    target = GraphSpec("target.onnx",
                       [t("input_ids", "int64", ["batch", "seq"]), t("position_ids", "int64", ["batch", "seq"])] + kv("past", L, "past", H, D),
                       [t("logits", "float32", ["batch", "seq", V]), t("next_ids", "int64", ["batch", "seq"])])
    ctx = GraphSpec("draft_context.onnx", [t("taps", f, ["batch", "ctx", TH]), t("ctx_position_ids", "int64", ["batch", "ctx"])], [])
    block = GraphSpec("draft_block.onnx",
                      [t("block_ids", "int64", ["batch", k]), t("block_position_ids", "int64", ["batch", k])] + kv("past_ctx", DL, "past_ctx", DH, DD),
                      [t("draft_ids", "int64", ["batch", k - 1])])
    return Manifest(block_size=k, mask_token_id=V - 2, target_layer_ids=[0, 1, 1], dtype=dtype, vocab_size=V,
                    max_context=max_context, hidden_size=32, target_layers=L, target_kv_heads=H, target_head_dim=D,
                    draft_layers=DL, draft_kv_heads=DH, draft_head_dim=DD, architecture="qwen3", eos_token_ids=[V - 1],
                    opset=20, graphs={"target": target, "draft_context": ctx, "draft_block": block}, tools={},
                    files={"target.onnx": "ab" * 32})


def shapes(plan, graph):
    return {p["name"]: p["shapes"] for p in next(g for g in plan.graphs if g.graph == graph).profiles}


@pytest.mark.parametrize("k,mc,mp", [(4, 64, None), (4, 256, 100), (16, 2048, None), (16, 2048, 512), (16, 48, 32)])
def test_profiles_pinned(k, mc, mp):
    plan = build_plan(manifest(k, mc), max_prompt=mp)
    mp = mc // 2 if mp is None else mp
    assert (plan.limits.block_size, plan.limits.max_context, plan.limits.max_prompt) == (k, mc, mp)
    tgt = shapes(plan, "target")
    assert list(tgt) == ["verify", "prefill"]  # profile 0 = verify, 1 = prefill: the backend relies on the order
    # verify: seq 1 .. K (adaptive verify checks a prefix of the block), opt K; past 0 .. max_context - 1
    assert tgt["verify"]["input_ids"] == [[1, 1], [1, k], [1, k]]
    assert tgt["verify"]["past_key.0"] == [[1, 0, H, D], [1, (mc - 1) // 2, H, D], [1, mc - 1, H, D]]
    # prefill: seq 1 .. max_prompt, past 0 .. max_context - 1 (chunked prefill, 1-token decoding)
    assert tgt["prefill"]["position_ids"] == [[1, 1], [1, (1 + mp) // 2], [1, mp]]
    assert tgt["prefill"]["past_value.1"] == [[1, 0, H, D], [1, (mc - 1) // 2, H, D], [1, mc - 1, H, D]]
    # context: ctx 1 .. max(max_prompt, K), opt K (the per-round size)
    ctx = shapes(plan, "draft_context")["context"]
    assert ctx["taps"] == [[1, 1, TH], [1, min(k, max(mp, k)), TH], [1, max(mp, k), TH]]
    # block: K static in every shape, past_ctx 1 .. max_context - 1
    blk = shapes(plan, "draft_block")["block"]
    assert blk["block_ids"] == [[1, k]] * 3
    assert blk["past_ctx_key.0"] == [[1, 1, DH, DD], [1, mc // 2, DH, DD], [1, mc - 1, DH, DD]]
    assert [g.engine for g in plan.graphs] == list(ENGINE_FILES.values())
    assert f"max prompt {mp}" in describe(plan)


@pytest.mark.parametrize("export", ["fp32", "fp16", "bf16"])
def test_precision_is_the_exports(export):
    plan = build_plan(manifest(dtype=export), workspace_gb=2)
    assert plan.precision == export and plan.workspace_bytes == 2 << 30
    assert build_plan(manifest(dtype=export), precision=export).precision == export
    assert f"precision {export} (strongly typed" in describe(plan)
    for other in {"fp32", "fp16", "bf16"} - {export}:  # no weak typing: any other precision is a re-export
        with pytest.raises(DFlashError, match=rf"--precision {other} but the graphs were exported in {export}; .*"
                                              rf"re-export with `dflash-export export --dtype {other}`"):
            build_plan(manifest(dtype=export), precision=other)
        with pytest.raises(DFlashError, match=f"exported in {export}"):
            ort_trt_provider_options(manifest(dtype=export), "target", precision=other)


@pytest.mark.parametrize("version,ok", [("10.11.0.33", False), ("10.12.0.36", True), ("10.15.1", True),
                                        ("11.0.0.114", True), ("11.5.0+fake", True), ("12.0.0", False),
                                        ("9.3.0", False)])
def test_supported_tensorrt_range(version, ok):
    if ok:
        check_trt_version(version)
    else:
        with pytest.raises(DFlashError, match=rf"TensorRT {version} is not supported: .* needs TensorRT >= 10\.12, < 12"):
            check_trt_version(version)


@pytest.mark.parametrize("kw,needle", [
    (dict(max_context=128), "exceeds the export's max_context 64"),
    (dict(max_context=4), "too small for block size 4"),
    (dict(max_prompt=61), "between 1 and max_context - block_size = 60"),
    (dict(max_prompt=0), "between 1 and"),
    (dict(precision="fp16", export="fp32"), "exported in fp32"),
    (dict(precision="fp32", export="fp16"), "exported in fp16"),
    (dict(precision="int8"), "choose one of fp32, fp16, bf16"),
    (dict(workspace_gb=0), "--workspace"),
])
def test_plan_refuses(kw, needle):
    m = manifest(dtype=kw.pop("export", "fp32"))
    with pytest.raises(DFlashError, match=needle.replace("(", r"\(")):
        build_plan(m, **kw)


def test_profile_must_cover_every_dynamic_dim():
    with pytest.raises(InternalError, match="input taps has the dynamic dim 'ctx' but TensorRT profile 'p' gives it no range"):
        Profile("p", {"batch": (1, 1, 1)}).shapes(manifest(), "draft_context")


def test_plan_imports_no_tensorrt():
    code = ("import sys; import dflash_export.export.trt_build, dflash_export.export.trt_lint, "
            "dflash_export.runtime.profiles, dflash_export.runtime.ort.trt_provider, dflash_export.runtime.trt.backend, "
            "dflash_export.cli.trt; "
            "assert not {'tensorrt', 'cuda', 'polygraphy'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ort_trt_provider_options(tmp_path):
    m = manifest(k=4, max_context=64)
    o = ort_trt_provider_options(m, "target", max_prompt=20, cache_dir=tmp_path)
    # one profile per graph for ORT: union of verify and prefill, opt at the verify shape
    assert o["trt_profile_min_shapes"] == "input_ids:1x1,position_ids:1x1," + ",".join(
        f"past_{kind}.{i}:1x0x{H}x{D}" for i in range(L) for kind in ("key", "value"))
    assert o["trt_profile_opt_shapes"].startswith(f"input_ids:1x4,position_ids:1x4,past_key.0:1x31x{H}x{D}")  # verify opt: past (64 - 1) // 2
    assert o["trt_profile_max_shapes"].startswith(f"input_ids:1x20,position_ids:1x20,past_key.0:1x63x{H}x{D}")
    assert o["trt_engine_cache_enable"] is True and o["trt_engine_cache_path"] == str(tmp_path)
    assert not any(k in o for k in ("trt_fp16_enable", "trt_bf16_enable", "trt_int8_enable"))  # weak typing: gone
    b = ort_trt_provider_options(m, "draft_block")
    assert b["trt_profile_min_shapes"] == f"block_ids:1x4,block_position_ids:1x4,past_ctx_key.0:1x1x{DH}x{DD},past_ctx_value.0:1x1x{DH}x{DD}"
    assert b["trt_profile_max_shapes"].endswith(f"past_ctx_value.0:1x63x{DH}x{DD}")
    c = ort_trt_provider_options(manifest(dtype="fp16"), "draft_context", precision="fp16")
    assert c["trt_profile_max_shapes"] == f"taps:1x32x{TH},ctx_position_ids:1x32"


def test_ort_cache_lives_outside_the_export(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    m = manifest()
    d = default_cache_dir(m)
    assert d.parent == tmp_path / "cache" and len(d.name) == 16
    m2 = manifest()
    m2.files = {"target.onnx": "cd" * 32}  # another artifact gets another cache folder
    assert default_cache_dir(m2) != d


def test_engine_record_checks():
    rec = {"tensorrt": "10.9.0.34", "compute_capability": "9.0", "gpu": "NVIDIA H100"}
    check_engine_record(rec, "10.9.0.34", "9.0")
    with pytest.raises(DFlashError, match="no TensorRT engines; build them first with `dflash-export build OUT`"):
        check_engine_record(None, "10.9.0.34", "9.0")
    with pytest.raises(DFlashError, match=r"built with TensorRT 10\.9\.0\.34 but this process has TensorRT 10\.13\.0"):
        check_engine_record(rec, "10.13.0", "9.0")
    with pytest.raises(DFlashError, match=r"compute capability 9\.0 \(NVIDIA H100\) but this GPU is 8\.9"):
        check_engine_record(rec, "10.9.0.34", "8.9")


def test_batch_profiles_for_ragged_exports():
    """`build --max-batch N`: every profile takes batch 1..N (opt N) and the ragged inputs; the
    block stays static. Exports made before ragged batches are refused in one line."""
    m = manifest(k=4)
    m.ragged = True
    plan = build_plan(m, max_batch=4)
    s = shapes(plan, "target")
    assert s["verify"]["past_lengths"] == [[1], [4], [4]]
    assert s["verify"]["logits_index"] == [[1, 1], [4, 4], [4, 4]] and s["prefill"]["logits_index"][1] == [4, 1]
    assert s["verify"]["past_key.0"] == [[0, 1, H, D], [31, 4, H, D], [63, 4, H, D]]  # position-major
    b = shapes(plan, "draft_block")["block"]
    assert b["block_ids"] == [[1, 4], [4, 4], [4, 4]] and b["ctx_lengths"] == [[1], [4], [4]]
    assert "batch 1..4" in describe(plan)
    with pytest.raises(DFlashError, match="re-export"):
        build_plan(manifest(), max_batch=2)
