"""The "ort" attention flavour (export --attention ort): GroupQueryAttention over a cache
updated in place. Same tokens as the PyTorch target, parity in `check`, one buffer per
cache bound as past and present, TensorRT refused by name.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from click.testing import CliRunner
from runtime_cases import ORT_CASES, artifact, prompts

from dflash_export.cli import cli
from dflash_export.export.check import run_check
from dflash_export.export.trt_lint import lint_dir
from dflash_export.models import Target, autoregressive_generate
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import VerifyPolicy
from dflash_export.runtime.sampling import Sampling


@pytest.fixture(scope="module", params=list(ORT_CASES))
def case(request):
    return artifact(ORT_CASES[request.param])


def test_manifest_and_graph_say_the_flavour(case):
    import onnx

    _, _, out = case
    m = M.load_manifest(out)
    assert m.attention == "ort"
    model = onnx.load(str(out / C.GRAPH_FILES[C.TARGET]), load_external_data=False)
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert ("com.microsoft", "GroupQueryAttention") in ops
    # residual add + RMSNorm as one node, twice per layer; rotary inside GQA where the head dim allows
    assert sum(n.op_type == "SkipSimplifiedLayerNormalization" for n in model.graph.node) == 2 * m.target_layers
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    rotary = m.target_head_dim % 16 == 0
    assert all(any(a.name == "do_rotary" and a.i == 1 for a in n.attribute) == rotary for n in gqa)
    assert all(all(n.input[7:9]) == rotary for n in gqa)  # + cos_cache, sin_cache
    # each row's count of new tokens (query_seqlens, input 16): rows of different lengths verify in one call
    assert m.row_counts and all(len(n.input) == 17 and n.input[16] and not any(n.input[9:16]) for n in gqa)
    assert [i.name for i in model.graph.input][:4] == [C.INPUT_IDS, C.POSITION_IDS, C.SEQLENS_K, C.TOTAL_LEN]
    cache = next(i for i in m.graphs[C.TARGET].inputs if i.name == "past_key.0")
    assert cache.shape[1:] == [m.target_kv_heads, m.max_context, m.target_head_dim]  # head-major, whole buffer
    for g in (C.DRAFT_CONTEXT, C.DRAFT_BLOCK):  # the drafter graphs stay standard ops
        drafter = onnx.load(str(out / C.GRAPH_FILES[g]), load_external_data=False)
        assert all(n.domain in ("", "ai.onnx") for n in drafter.graph.node)


def test_greedy_equals_the_pytorch_target(case):
    """Speculative (full block and adaptive) == plain ORT == PyTorch greedy, token for token."""
    t_dir, d_dir, out = case
    m = M.load_manifest(out)
    target = Target.from_pretrained(t_dir, m.target_layer_ids)
    be = OrtBackend(out, threads=1)
    accepted = 0
    for prompt in prompts(6, m.vocab_size, seed=11):
        ref = autoregressive_generate(target, prompt, 24, stop_token_ids=()).tokens
        plain = generate(be, prompt, 24, draft=False, stop_token_ids=())
        spec = generate(be, prompt, 24, stop_token_ids=())
        adaptive = generate(be, prompt, 24, stop_token_ids=(), verify=VerifyPolicy(0.3, 1))
        assert plain.tokens == ref and spec.tokens == ref and adaptive.tokens == ref
        accepted += sum(a - 1 for a in spec.acceptance_lengths)
    print(f"{out.name}: 6 prompts x 24 tokens identical to PyTorch greedy; {accepted} drafts accepted")


def test_sampling_matches_plain_sampling(case):
    _, _, out = case
    be = OrtBackend(out, threads=1)
    for seed, prompt in enumerate(prompts(3, be.manifest.vocab_size, seed=12)):
        s, compare = Sampling(0.8, top_k=20, seed=seed), Sampling(0.8, top_k=20, seed=seed, method="compare")
        kw = dict(stop_token_ids=())
        assert (generate(be, prompt, 20, sampling=compare, **kw).tokens
                == generate(be, prompt, 20, draft=False, sampling=s, **kw).tokens)
        assert generate(be, prompt, 20, sampling=s, **kw).tokens == generate(be, prompt, 20, sampling=s, **kw).tokens


def test_cache_is_one_buffer_updated_in_place(case):
    _, _, out = case
    be = OrtBackend(out, threads=1)
    m = be.manifest
    be.trace = []
    be.reset()
    be.target(np.arange(5, dtype=np.int64))
    be.commit(5)
    be.target(np.arange(3, dtype=np.int64))
    bound = {}  # the caches are bound once, on the first call, and stay bound
    for name, ptr, shape in be.trace:
        bound[name] = (ptr, shape)
    for i in range(m.target_layers):
        past, present = bound[be.names.past_key[i]], bound[be.names.present_key[i]]
        assert past == present == (be.kv[2 * i].ctypes.data, (1, m.target_kv_heads, m.max_context, m.target_head_dim))
    k = be.kv[0][0]  # [Hkv, max, D]: rows 0..7 written (5 committed + 3 pending), the rest untouched
    assert np.abs(k[:, :8]).sum(-1).min() > 0 and not k[:, 8:].any()


def test_check_passes_with_printed_errors(case):
    t_dir, d_dir, out = case
    report = run_check(out, t_dir, d_dir, prompts=4, max_new_tokens=12, progress=False)
    print(report.summary())
    assert report.passed, report.summary()
    presents = [r for r in report.rows if r.graph == C.TARGET and r.output.startswith("present_")]
    assert presents and all(r.max <= r.tol for r in presents)


def test_tensorrt_lint_names_the_flavour(case):
    _, _, out = case
    errors = [f for f in lint_dir(out) if f.level == "error"]
    assert errors and "--attention standard" in str(errors[0])


def test_export_refuses_a_hybrid_target_and_a_bad_flavour(tmp_path):
    from dflash_export.export.artifact import export_artifact
    from dflash_export.models.tiny import make_drafter, make_target

    make_target(tmp_path / "t", "qwen35", layers=4, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48)
    make_drafter(tmp_path / "d", tmp_path / "t", layers=1, block_size=4)
    with pytest.raises(DFlashError, match="--attention standard only"):
        export_artifact(tmp_path / "t", tmp_path / "d", tmp_path / "out", attention="ort", progress=False)
    r = CliRunner().invoke(cli, ["export", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--out",
                                 str(tmp_path / "o2"), "--attention", "flash"])
    assert r.exit_code != 0 and "--attention" in r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "o2").exists()


def test_unknown_flavour_in_a_manifest_is_refused(case, tmp_path):
    import json
    import shutil

    _, _, out = case
    copy = tmp_path / "a"
    shutil.copytree(out, copy)
    raw = json.loads((copy / C.MANIFEST).read_text())
    raw["attention"] = "flash"
    (copy / C.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match="attention flavour 'flash'"):
        M.load_manifest(copy)


def test_step_ms_by_context(case):
    from dflash_export.runtime.calibrate import step_ms_by_context

    _, _, out = case
    be = OrtBackend(out, threads=1)
    ms = step_ms_by_context(be, [8, 128], repeats=3)
    assert set(ms) == {"8", "128"} and all(v > 0 for v in ms.values())


def test_serve_engine_runs_the_flavour_with_prompt_reuse(case, monkeypatch):
    """serve's engine over an ort-flavour export: forked slots share the sessions, each its own
    head-major cache; a follow-up prompt reuses the cached prefix and still equals plain decoding."""
    import queue

    from dflash_export.runtime.loop import Request
    from dflash_export.serve.engine import load_engine
    from dflash_export.serve.jobs import Job
    from dflash_export.serve.options import ServeOptions

    no_text = types.SimpleNamespace(template_source=None)  # this artifact has no tokenizer
    monkeypatch.setattr("dflash_export.serve.text.Text", lambda *args: no_text)
    _, _, out = case
    be = OrtBackend(out, threads=1)
    engine = load_engine(ServeOptions(out, slots=2, model_name="m", threads=1, verify="full"))
    eos = tuple(be.manifest.eos_token_ids)  # the engine stops on them too

    def run(prompt: list[int]):
        events: queue.Queue = queue.Queue()
        engine.submit(Job(Request(prompt, 16), emit=events.put))  # stops: the model's eos ids
        while (ev := events.get(timeout=60))[0] != "end":
            pass
        return ev[2]

    try:
        for prompt in prompts(3, be.manifest.vocab_size, seed=13):
            first = run(prompt)
            again = run(prompt + first.tokens[:5])
            assert again.reused >= len(prompt)  # the slot that ran `prompt` took it: its cache held the prefix
            for p, g in ((prompt, first), (prompt + first.tokens[:5], again)):
                assert g.tokens == generate(be, p, 16, draft=False, stop_token_ids=eos).tokens
    finally:
        engine.close()


def test_quantized_ort_flavour_passes_check(case, tmp_path):
    """quantize keeps the flavour (GroupQueryAttention next to MatMulNBits) and `check` passes."""
    import onnx

    from dflash_export.export.quantize import QuantOptions, quantize_artifact

    t_dir, d_dir, out = case
    q = tmp_path / "q"
    quantize_artifact(out, q, QuantOptions("int8", 32, True, draft=True), progress=False)
    m = M.load_manifest(q)
    assert m.attention == "ort" and m.quantization["scheme"] == "int8"
    ops = {n.op_type for n in onnx.load(str(q / C.GRAPH_FILES[C.TARGET]), load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "MatMulNBits"} <= ops
    report = run_check(q, t_dir, d_dir, prompts=3, max_new_tokens=12, progress=False)
    assert report.passed, report.summary()


def test_info_shows_the_flavour(case):
    import json

    _, _, out = case
    r = CliRunner().invoke(cli, ["info", str(out), "--no-verify"])
    assert r.exit_code == 0 and "attention ort" in r.output and C.SEQLENS_K in r.output, r.output
    assert "present_key.{i}" in r.output and "new_key.{i}" not in r.output
    d = json.loads(CliRunner().invoke(cli, ["info", str(out), "--json", "--no-verify"]).output)
    cache = next(t for t in d["graphs"][C.TARGET]["inputs"] if t["name"] == "past_key.0")
    m = M.load_manifest(out, verify=False)
    assert d["attention"] == "ort" and cache["shape"] == ["batch", m.target_kv_heads, m.max_context, m.target_head_dim]
