"""fp16 and bf16 exports: weights, K/V and taps in half precision, logits float32.

fp16 runs in ONNX Runtime's CPU provider, so `check` reports real error statistics and
top-1 agreement (not held to fp32 tolerances). The CPU provider has no bf16 kernels:
the bf16 artifact is validated statically, and `check` and `generate` say in one line
that the CPU provider cannot run it.
"""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner
from runtime_cases import FP16, artifact

from dflash_export.cli import cli
from dflash_export.export.artifact import export_artifact
from dflash_export.export.validate import lint
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.names import names_of
from dflash_export.models.tiny import make_drafter, make_target


def exported(dtype, directory):
    """fp16: runtime_cases.FP16, the cached pair the TensorRT lint checks too; bf16: a
    1-layer Qwen2 pair exported here (nothing else uses it)."""
    if dtype == "fp16":
        return artifact(FP16)
    target = make_target(directory / "target", "qwen2", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=48)
    draft = make_drafter(directory / "draft", target, layers=1, block_size=4)
    m = export_artifact(target, draft, directory / dtype, dtype=dtype, progress=False)
    assert M.load_manifest(directory / dtype) == m
    return target, draft, directory / dtype


# kv_width: the drafter's K/V projection width, kv heads x head dim (Qwen3 32, Qwen2 hidden / heads = 8)
@pytest.mark.parametrize("dtype,np_name,itemsize,kv_width", [("fp16", "float16", 2, 2 * 32), ("bf16", "bfloat16", 2, 2 * 8)])
def test_half_export(tmp_path, dtype, np_name, itemsize, kv_width):
    target, draft, out = exported(dtype, tmp_path)
    m = M.load_manifest(out)
    assert m.dtype == dtype
    t = {x.name: x.dtype for x in m.graphs[C.TARGET].inputs + m.graphs[C.TARGET].outputs}
    N = names_of(m)
    kv = [*N.past_key, *N.past_value, *N.new_key, *N.new_value]
    assert {t[n] for n in kv} == {t["taps"]} == {np_name}  # every layer's K/V
    assert t["logits"] == "float32" and t["next_ids"] == "int64"
    b = {x.name: x.dtype for x in m.graphs[C.DRAFT_BLOCK].outputs}
    assert b == {"draft_ids": "int64", "draft_logits": "float32", "draft_conf": "float32"}
    # stored once, in the export dtype: embedding, LM head (untied) and the drafter's k/v projections
    assert {t.dtype for t in m.shared.values()} == {np_name}
    stored = sum(t.length for t in m.shared.values())
    assert stored == (2 * 101 * 32 + 2 * kv_width * 32) * itemsize
    assert stored <= (out / "shared.data").stat().st_size < stored + 4096 * len(m.shared)
    for f in C.GRAPH_FILES.values():
        assert lint(onnx.load(str(out / f), load_external_data=False)) == []

    r = CliRunner().invoke(cli, ["check", str(out), "--target", str(target), "--draft", str(draft),
                                 "--num-prompts", "5", "--max-new-tokens", "12", "--json"])
    report = json.loads(r.stdout)
    if dtype == "bf16":
        assert r.exit_code == 1 and not report["passed"]
        assert "CPU provider cannot run bf16" in report["notes"][0]
        r = CliRunner().invoke(cli, ["generate", str(out), "--prompt-ids", "1,2,3", "--json"])  # the runtime too
        assert r.exit_code == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
        assert "CPU provider cannot run bf16 graphs; use --provider cuda" in r.stderr and not r.stdout
        return
    assert r.exit_code == 0 and report["passed"] and report["tolerance"] is None
    logits = [row for rows in report["graphs"].values() for row in rows if row["output"] in ("logits", "draft_logits")]
    assert len(logits) == 10  # 3 target + 2 block regimes + the head over fewer drafts, 2 ragged rows of each (export/check_rows.py)
    for row in logits:  # reported, not enforced: but fp16 must be close and mostly agree
        assert row["tol"] is None and 0 < row["max"] < 0.05 and row["top1"] >= 0.9
    assert report["end_to_end"]["cases"] == 5
