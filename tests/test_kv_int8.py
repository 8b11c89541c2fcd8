"""The ort flavour's int8 K/V cache (export --attention ort --kv-cache int8): ONNX Runtime's
GroupQueryAttention quantized cache against the eager reference (export/gqa.py), the export's
parity in `check`, speculative == the int8 target's own greedy (batch 1 and batch > 1), the refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from runtime_cases import KV8_CASES, artifact, prompts

from dflash_export.cli import cli
from dflash_export.export.check import run_check
from dflash_export.export.gqa import gqa
from dflash_export.export.trt_lint import lint_dir
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.loop import Request, generate, generate_batch
from dflash_export.runtime.memory import cache_bytes_per_position
from dflash_export.runtime.ort.backend import OrtBackend


@pytest.fixture(scope="module", params=list(KV8_CASES))
def case(request):
    return artifact(KV8_CASES[request.param])


def _gqa_node(h: int, hkv: int, d: int, max_len: int):
    """One GroupQueryAttention node with a per-channel int8 cache and rotary, as the export writes it."""
    import onnxruntime as ort
    from onnx import TensorProto as TP, helper

    attrs = dict(domain="com.microsoft", num_heads=h, kv_num_heads=hkv, do_rotary=1, k_quant_type="PER_CHANNEL",
                 v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tot", "cos", "sin", "", "", "",
                                                    "ks", "vs"], ["o", "ppk", "ppv"], **attrs)
    vi = helper.make_tensor_value_info
    cache = ["B", hkv, max_len, d]
    g = helper.make_graph([node], "g", [
        vi("q", TP.FLOAT, ["B", "S", h * d]), vi("k", TP.FLOAT, ["B", "S", hkv * d]), vi("v", TP.FLOAT, ["B", "S", hkv * d]),
        vi("pk", TP.INT8, cache), vi("pv", TP.INT8, cache), vi("sl", TP.INT32, ["B"]), vi("tot", TP.INT32, []),
        vi("cos", TP.FLOAT, [max_len, d // 2]), vi("sin", TP.FLOAT, [max_len, d // 2]),
        vi("ks", TP.FLOAT, [hkv, 1, d]), vi("vs", TP.FLOAT, [hkv, 1, d])],
        [vi("o", TP.FLOAT, ["B", "S", h * d]), vi("ppk", TP.INT8, cache), vi("ppv", TP.INT8, cache)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_onnxruntime_int8_cache_is_the_reference():
    """ORT stores round_half_even(x * (1 / scale)) clamped to [-128, 127], K after rotary, scales [Hkv, 1, D]
    per channel, and attends over the dequantized cache (new rows included): the eager `gqa` does the same."""
    h, hkv, d, n, p, s = 4, 2, 32, 16, 5, 3
    rng = np.random.default_rng(0)
    sess = _gqa_node(h, hkv, d, n)
    ks, vs = (rng.uniform(0.01, 0.05, (hkv, 1, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, s, h * d), dtype=np.float32)
    k, v = (rng.standard_normal((1, s, hkv * d), dtype=np.float32) for _ in range(2))
    v.reshape(-1)[:6] = np.array([0.5, 1.5, -2.5, 900.0, -900.0, 2.5], np.float32) * vs[0, 0, :6]  # halves, clamps
    # near halves: x * (1 / s) and x / s round apart on some of these (ORT multiplies)
    v[0, 1] = (rng.integers(-100, 100, hkv * d) + 0.5).astype(np.float32) * vs.reshape(-1)
    pk, pv = (np.zeros((1, hkv, n, d), np.int8) for _ in range(2))
    pk[:, :, :p], pv[:, :, :p] = (rng.integers(-128, 128, (1, hkv, p, d)) for _ in range(2))
    freqs = np.arange(n)[:, None] / 10000 ** (np.arange(0, d, 2) / d)[None]
    cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
    feeds = dict(q=q, k=k, v=v, pk=pk, pv=pv, sl=np.array([p + s - 1], np.int32), tot=np.array(p + s, np.int32),
                 cos=cos, sin=sin, ks=ks, vs=vs)
    o, ppk, ppv = sess.run(None, feeds)
    t = {name: torch.from_numpy(x) for name, x in feeds.items()}
    ro, rk, rv = gqa(t["q"], t["k"], t["v"], t["pk"], t["pv"], t["sl"], t["tot"], t["cos"], t["sin"], h, hkv, None,
                     t["ks"], t["vs"])
    assert rv.dtype == torch.int8 and rv[0, 0, p, :5].tolist() == [0, 2, -2, 127, -128]
    assert np.array_equal(ppk[:, :, :p + s], rk[:, :, :p + s].numpy())  # K stored rotated, quantized alike
    assert np.array_equal(ppv[:, :, :p + s], rv[:, :, :p + s].numpy())
    err = float(np.abs(o - ro.numpy()).max())
    print(f"GroupQueryAttention int8 per-channel vs eager gqa: caches equal, output max error {err:.1e} (tolerance 1e-5)")
    assert err < 1e-5


def test_manifest_graph_and_runtime_say_int8(case):
    import onnx

    _, _, out = case
    m = M.load_manifest(out)
    assert m.kv_cache["dtype"] == "int8" and m.kv_cache["scales"] == "per-channel"
    assert C.dtype(C.CACHE_KV[0], m) == "int8" and m.graphs[C.TARGET].inputs[-1].dtype == "int8"
    model = onnx.load(str(out / C.GRAPH_FILES[C.TARGET]), load_external_data=False)
    gqa_nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa_nodes) == m.target_layers and all(n.input[12] and n.input[13] for n in gqa_nodes)
    be = OrtBackend(out, threads=1)
    assert all(b is None or b.dtype == np.int8 for b in be.kv)
    # the memory check counts a byte per cached value
    assert cache_bytes_per_position(m, drafter=False) == 2 * m.target_layers * m.target_kv_heads * m.target_head_dim


def test_speculative_equals_the_int8_targets_greedy(case):
    """Lossless through the int8-cache graphs: batch 1 and a ragged batch of 3."""
    _, _, out = case
    be = OrtBackend(out, threads=1)
    ps = prompts(4, be.manifest.vocab_size, seed=21)
    plain = [generate(be, p, 20, draft=False, stop_token_ids=()).tokens for p in ps]
    accepted = 0
    for p, ref in zip(ps, plain):
        spec = generate(be, p, 20, stop_token_ids=())
        assert spec.tokens == ref
        accepted += sum(a - 1 for a in spec.acceptance_lengths)
    batch = OrtBackend(out, threads=1, max_batch=3)
    got, _ = generate_batch(batch, [Request(p, 20, stop_token_ids=()) for p in ps[:3]])
    assert [g.tokens for g in got] == plain[:3]
    print(f"{out.name}: 4 prompts x 20 tokens, speculative (batch 1 and 3) == plain greedy; {accepted} drafts accepted")


def test_check_passes_with_printed_errors(case):
    t_dir, d_dir, out = case
    report = run_check(out, t_dir, d_dir, prompts=4, max_new_tokens=12, progress=False)
    print(report.summary())
    assert report.passed, report.summary()
    presents = [r for r in report.rows if r.graph == C.TARGET and r.output.startswith("present_")]
    assert presents and all(r.tol == 1.0 and r.max <= 1 for r in presents)
    assert report.end_to_end["speculative_equals_plain"] == report.end_to_end["cases"]
    assert any("values it stored were one step from ONNX Runtime" in n for n in report.notes), report.notes


def test_refusals_are_one_line_and_write_nothing(tmp_path):
    t_dir, d_dir, _ = artifact(KV8_CASES["qwen3"])
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("a prompt\n")
    ort8 = ["--attention", "ort", "--kv-cache", "int8"]
    for extra, words in ((["--kv-cache", "int8"], "needs --attention ort"),
                         (["--kv-calibration", str(prompts_file)], "needs --kv-cache int8"),
                         ([*ort8, "--kv-calibration", str(tmp_path / "none.txt")], "unreadable"),
                         ([*ort8, "--kv-calibration", str(prompts_file)], "needs the target's tokenizer.json")):
        out = tmp_path / "out"
        r = CliRunner().invoke(cli, ["export", "--target", str(t_dir), "--draft", str(d_dir), "--out", str(out),
                                     "--quiet", *extra])
        assert r.exit_code == 2 and words in r.output and r.output.count("\n") == 1, r.output
        assert not out.exists()


def test_info_shows_the_cache_type(case):
    _, _, out = case
    r = CliRunner().invoke(cli, ["info", str(out), "--no-verify"])
    assert r.exit_code == 0 and "kv cache int8, per-channel scales" in r.output, r.output
    assert any("past_key.{i}" in ln and ln.rstrip().split("]")[-1].split()[0] == "int8" for ln in r.output.splitlines())


def test_int4_weights_keep_the_int8_cache(tmp_path):
    """quantize keeps the scales and the record; check: parity vs the dequantized weights, speculative == plain."""
    from dflash_export.export.quantize import QuantOptions, quantize_artifact

    t_dir, d_dir, out = artifact(KV8_CASES["qwen3"])
    q = quantize_artifact(out, tmp_path / "q", QuantOptions(scheme="int4", block_size=16), progress=False)
    assert q.kv_cache == M.load_manifest(out).kv_cache and q.quantization["scheme"] == "int4"
    report = run_check(tmp_path / "q", t_dir, d_dir, prompts=3, max_new_tokens=12, progress=False)
    print(report.summary())
    assert report.passed and report.end_to_end["speculative_equals_plain"] == 3, report.summary()


def test_tensorrt_refuses_it_by_the_flavour():
    """TensorRT cannot run GroupQueryAttention: `build` refuses the ort flavour, int8 cache or not."""
    _, _, out = artifact(KV8_CASES["qwen3"])
    errors = [f for f in lint_dir(out) if f.level == "error"]
    assert errors and "--attention standard" in str(errors[0])


def test_calibration_prompts_come_from_the_tokenizer(tmp_path):
    """With a tokenizer: the seed prompts, or --kv-calibration's lines, tokenized; without: fixed ids."""
    from pathlib import Path

    from dflash_export.export.kv_calibrate import SEEDS, seed_prompts

    demo = Path(__file__).resolve().parents[1] / "demo" / "pair" / "target"
    ids, source = seed_prompts(demo, 4096, None)
    assert source == "seed prompts" and len(ids) == len(SEEDS) and all(ids)
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\nsecond one\n")
    ids, source = seed_prompts(demo, 4096, f)
    assert source == str(f) and len(ids) == 2
    ids, source = seed_prompts(tmp_path, 100, None)
    assert source == "random token ids" and all(0 <= i < 100 for p in ids for i in p)
