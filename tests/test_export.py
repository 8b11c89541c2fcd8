"""Export of a tiny Llama (tied embeddings, llama3 RoPE) with a 1-layer drafter, block 4,
tapping layer 1 (the last: post-final-norm, as transformers' hidden_states).

The artifact is the shared runtime_cases.CASES["llama"] (exported once per content, as the
runtime tests use it); `check` is run through the CLI (parity per graph + 20 prompts end to
end), the manifest, shared weights (also on CASES["qwen3"]: untied, 2 drafter layers), op lint
and tamper detection are checked on the files themselves. The export's own file handling
(--force, tokenizer files, no temporaries) is checked on the CLI export of test_draft_vocab.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from tiny_exports import exported_taps_error
from runtime_cases import CASES, artifact

from dflash_export.cli import cli
from dflash_export.export import trt_lint
from dflash_export.runtime.contract import SHARED_DATA
from dflash_export.export.validate import lint
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.errors import DFlashError


@pytest.fixture(scope="module")
def art():
    target, draft, out = artifact(CASES["llama"])
    return target, draft, out, M.load_manifest(out)


def test_manifest_describes_the_files(art):
    target, draft, out, m = art  # load_manifest verified every sha256
    assert (m.block_size, m.dtype, m.architecture, m.target_layers, m.draft_layers) == (4, "fp32", "LlamaForCausalLM", 2, 1)
    assert m.mask_token_id == 99 and m.vocab_size == 101 and m.eos_token_ids == [100]
    assert set(m.files) == {p.name for p in out.iterdir()} - {C.MANIFEST}
    assert {"torch", "onnx", "onnxruntime"} <= set(m.tools)
    t = m.graphs[C.TARGET]
    assert m.ragged  # ragged batches: per-row lengths, position-major caches, logits picks (contract.RAGGED)
    assert [x.name for x in t.inputs][:6] == ["input_ids", "position_ids", "past_lengths", "logits_index",
                                              "past_key.0", "past_value.0"]
    assert [x.name for x in t.outputs][:4] == ["logits", "next_ids", "taps", "new_key.0"]
    spec = {x.name: x for x in t.inputs + t.outputs}
    assert spec["past_key.1"].shape == ["past", "batch", 2, 16] and spec["past_key.1"].dtype == "float32"
    assert spec["new_key.1"].shape == ["batch", "seq", 2, 16]
    assert spec["logits"].shape == ["batch", "picks", 101] and spec["next_ids"].dtype == "int64"
    assert spec["taps"].shape == ["batch", "seq", 1 * 64]
    b = m.graphs[C.DRAFT_BLOCK]
    assert b.inputs[0].shape == ["batch", 4]  # static block
    assert [(x.name, x.shape) for x in b.outputs] == [("draft_ids", ["batch", "scored"]),
                                                  ("draft_logits", ["batch", "scored", 101]),
                                                  ("draft_conf", ["batch", "scored"])]  # the head over the drafts a verify uses
    ctx = m.graphs[C.DRAFT_CONTEXT]
    assert [x.name for x in ctx.outputs] == ["ctx_key.0", "ctx_value.0"]  # more layers: test_export_archs
    assert ctx.outputs[0].shape == ["batch", "ctx", 2, 16]


def _externals(path: Path) -> dict[str, dict]:
    model = onnx.load(str(path), load_external_data=False)
    return {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer}


def test_exported_taps_are_transformers_hidden_states(art):
    target, _, out, m = art
    assert m.target_layer_ids == [1] and m.target_layers == 2  # 1: the last layer
    err = exported_taps_error(out, target)
    print(f"llama: taps [1] of 2 layers, max abs error {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("case", ["llama", "qwen3"])  # tied, 1 drafter layer; untied, 2 drafter layers
def test_shared_weights_are_stored_once(case):
    out = artifact(CASES[case])[2]
    tied = bool(CASES[case].tie)
    target, block, ctx = (_externals(out / C.GRAPH_FILES[g]) for g in (C.TARGET, C.DRAFT_BLOCK, C.DRAFT_CONTEXT))
    for name in C.SHARED_INITIALIZERS:
        assert target[name] == block[name] and target[name]["location"] == SHARED_DATA
    # tied embeddings: both names are the same bytes
    assert (target["embed_tokens.weight"] == target["lm_head.weight"]) == tied
    assert not set(C.SHARED_INITIALIZERS) & set(ctx)
    # the manifest's table says where each is; the drafter's K/V projections serve both drafter graphs
    m = M.load_manifest(out)
    kv = {n for n in m.shared if n not in C.SHARED_INITIALIZERS}
    assert kv == {f"layers.{j}.self_attn.{p}_proj.weight" for j in range(m.draft_layers) for p in "kv"}
    for name, t in m.shared.items():
        want = ["target", "draft_block"] if name in C.SHARED_INITIALIZERS else ["draft_context", "draft_block"]
        assert t.graphs == want and t.file == SHARED_DATA
        for graph in want:
            ref = _externals(out / C.GRAPH_FILES[graph])[name]
            assert (ref["location"], int(ref["offset"]), int(ref["length"])) == (SHARED_DATA, t.offset, t.length)
    distinct = {(t.offset, t.length) for t in m.shared.values()}
    assert len(distinct) == len(m.shared) - tied  # tied: two names, one copy
    stored = sum(n for _, n in distinct)
    kv_bytes = m.draft_layers * 2 * m.draft_kv_heads * m.draft_head_dim * 64 * 4  # k, v of each drafter layer (fp32)
    assert stored == (1 if tied else 2) * 101 * 64 * 4 + kv_bytes  # embedding (+ untied LM head) + drafter k/v
    assert stored <= (out / SHARED_DATA).stat().st_size < stored + 4096 * len(distinct)  # alignment only
    for graph, refs in (("target", target), ("draft_block", block), ("draft_context", ctx)):
        assert all(r["location"] in (SHARED_DATA, f"{graph}.data") for r in refs.values() if r)  # {}: inline, < 1 KiB


def test_graphs_are_standard_onnx(art):
    out = art[2]
    for f in C.GRAPH_FILES.values():
        onnx.checker.check_model(str(out / f), full_check=True)
        model = onnx.load(str(out / f), load_external_data=False)
        assert lint(model) == []
        # weights keep their parameter names (no folded, renamed copies of a weight)
        external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert external and not [n for n in external if n.startswith("val_")]
    # and TensorRT's parser rules, as export/trt_lint.py knows them (shape constants folded)
    assert [f for f in trt_lint.lint_dir(out) if f.level == "error"] == []


def test_lint_catches_custom_ops():
    node = onnx.helper.make_node("FusedMatMul", ["a", "b"], ["c"], domain="com.microsoft")
    graph = onnx.helper.make_graph([node], "g", [], [])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18),
                                                         onnx.helper.make_opsetid("com.microsoft", 1)])
    problems = lint(model)
    assert any("com.microsoft::FusedMatMul" in p for p in problems) and any("opset import" in p for p in problems)


def test_check_passes_and_tokens_match_the_oracle(art, tmp_path):
    target, draft, out, _ = art
    pg = tmp_path / "pg"
    r = CliRunner().invoke(cli, ["check", str(out), "--target", str(target), "--draft", str(draft),
                                 "--num-prompts", "20", "--max-new-tokens", "16", "--json", "--save-polygraphy", str(pg)])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["passed"] is True
    assert report["end_to_end"]["cases"] == 20 and report["end_to_end"]["identical"] == 20
    assert report["end_to_end"]["acceptance_identical"] == 20
    cases = {row["case"] for rows in report["graphs"].values() for row in rows}
    assert {"prefill P=0 S=7", "step P=9 S=1", "verify P=9 S=4", "past_ctx=0 K=4", "past_ctx=9 K=4"} <= cases
    logits = [row for row in report["graphs"]["target"] if row["output"] == "logits"]
    assert all(0 <= row["max"] <= 1e-4 and row["tol"] == 1e-4 for row in logits)
    # the saved files re-check with Polygraphy's own ORT runner
    stem = pg / "target.step_P9_S1"
    cmd = [str(Path(sys.executable).parent / "polygraphy"), "run", str(out / "target.onnx"), "--onnxrt",
           "--load-inputs", f"{stem}.inputs.json", "--load-outputs", f"{stem}.outputs.json", "--atol", "1e-4", "--rtol", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "PASSED" in done.stdout + done.stderr, done.stdout[-2000:] + done.stderr[-2000:]


def test_check_fails_on_wrong_weights(art, tmp_path):
    """A consistent artifact whose weights differ from its source: check must say FAILED, exit 1."""
    target, draft, out, _ = art
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    data = np.fromfile(bad / "target.data", dtype=np.float32)
    data[:64] += 0.5  # the first tensor: layer 0's q_proj
    data.tofile(bad / "target.data")
    m = M.load_manifest(bad, verify=False)
    M.write_manifest(bad, m)
    r = CliRunner().invoke(cli, ["check", str(bad), "--target", str(target), "--draft", str(draft), "--num-prompts", "2"])
    assert r.exit_code == 1
    assert "FAILED" in r.stdout and "target prefill P=0 S=7 logits: max abs" in r.stdout


def test_check_decodes_the_prompts_of_a_file(art, tmp_path):
    """check --prompts FILE (as --help and docs/export.md show it): those prompts end to end, not random ones;
    a prompt the artifact cannot take is refused in one line before anything loads."""
    target, draft, out, _ = art
    prompts = tmp_path / "p.txt"
    prompts.write_text("1,2,3\n4,5,6,7,8\n9\n")
    args = ["check", str(out), "--target", str(target), "--draft", str(draft), "--max-new-tokens", "8"]
    r = CliRunner().invoke(cli, [*args, "--prompts", str(prompts), "--json"])
    assert r.exit_code == 0, r.output
    e2e = json.loads(r.stdout)["end_to_end"]
    assert e2e["cases"] == 3 and e2e["identical"] == 3 and e2e["max_new_tokens"] == 8
    prompts.write_text(",".join(["1"] * M.load_manifest(out).max_context) + "\n")
    r = CliRunner().invoke(cli, [*args, "--prompts", str(prompts)])
    assert r.exit_code == 2 and "prompt 1 has" in r.stderr and len(r.stderr.splitlines()) == 1, r.output
    prompts.write_text("text needs a tokenizer\n")
    r = CliRunner().invoke(cli, [*args, "--prompts", str(prompts)])
    assert r.exit_code == 2 and "text prompts need tokenizer.json" in r.stderr, r.output


def test_check_runs_a_narrow_reference_on_one_thread_and_ticks_per_prompt(art, monkeypatch):
    """A narrow model's PyTorch reference runs on one torch thread (a second only adds a handoff to
    each of its tiny ops: 20-50x slower on a busy shared machine), restored afterwards; the
    end-to-end phase reports each prompt as it starts (check's status line)."""
    import torch
    from dflash_export.export import check as export_check

    target, draft, out, m = art
    seen, ticks = [], []
    real = export_check.end_to_end

    def spy(*args, tick, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, tick=lambda i: (ticks.append(i), tick(i)), **kwargs)

    monkeypatch.setattr(export_check, "end_to_end", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        report = export_check.run_check(out, target, draft, prompts=3, max_new_tokens=4, progress=False)
        assert report.passed and seen == [1] and ticks == [0, 1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_tampering_is_detected(art, tmp_path):
    target, draft, out, _ = art
    bad = tmp_path / "tampered"
    shutil.copytree(out, bad)
    with open(bad / SHARED_DATA, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(DFlashError, match="shared.data does not match its sha256"):
        M.load_manifest(bad)
    r = CliRunner().invoke(cli, ["check", str(bad), "--target", str(target), "--draft", str(draft)])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    extra = tmp_path / "extra"
    shutil.copytree(out, extra)
    (extra / "notes.txt").write_text("x")
    with pytest.raises(DFlashError, match="notes.txt is not listed"):
        M.load_manifest(extra)


def test_check_requires_the_sources(art):
    target, draft, out, _ = art
    r = CliRunner().invoke(cli, ["check", str(out)])  # the recorded sources are gone (built in a renamed folder)
    assert r.exit_code == 2 and "pass --target and --draft" in r.stderr and len(r.stderr.splitlines()) == 1
    r = CliRunner().invoke(cli, ["check", str(out), "--target", str(target), "--draft", str(target)])
    assert r.exit_code == 2 and r.stderr.startswith("error: ")
