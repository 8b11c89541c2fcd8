"""Weight-only quantized DFlash 2 exports (export/quantize.py, `dflash-export quantize`): the
drafter's linear layers (the convolutions' kernel projections and the selector's hidden
projection among them) and the LM head in int4, `check`ed: every draft_block output, the
candidates and walk scores included, against PyTorch holding the dequantized weights (fp32
tolerance), the quantization error against the float source reported, and the deployed loop
token-identical to the dequantized oracle. The pair is tests/dflash2_trained.py's."""

from __future__ import annotations

import pytest

from dflash_export.export.check import run_check
from dflash_export.export.quantize import QuantOptions, quantize_artifact
from dflash_export.runtime import contract as C, manifest as M

pytest.importorskip("dflash.model", reason="the official z-lab package `dflash` 0.1.0 is not installed")


def test_int4_dflash2_export_checks(tmp_path):
    from dflash2_trained import trained_export

    root = trained_export()
    out = tmp_path / "q"
    quantize_artifact(root / "out", out, QuantOptions("int4", block_size=16, draft=True, lm_head=True, accuracy_level=0), progress=False)
    weights = M.load_manifest(out).quantization["weights"][C.DRAFT_BLOCK]
    assert "candidate_selector.hidden_projection.weight" in weights
    assert "layers.0.attention_conv.kernel_projection.weight" in weights and "layers.0.mlp_conv.kernel_projection.weight" in weights
    report = run_check(out, root / "t", root / "d", prompts=4, max_new_tokens=20, progress=False)
    assert report.passed, [r for r in report.rows if not r.passed]
    block = [r for r in report.rows if r.graph == C.DRAFT_BLOCK]
    for ref in ("dequantized", "float"):
        assert {C.DRAFT_IDS, C.DRAFT_CANDIDATES, C.DRAFT_SCORES, C.DRAFT_CONF} <= {r.output for r in block if r.ref == ref}
    scores = [r for r in block if r.output == C.DRAFT_SCORES]
    deq = max(r.max for r in scores if r.ref == "dequantized")
    flt = max(r.max for r in scores if r.ref == "float")
    print(f"draft_scores: max |onnx - dequantized pytorch| {deq:.1e}, vs the float drafter {flt:.2f}")
    assert deq < 1e-4 < flt  # parity with what the graph multiplies by; the quantization error is there
    e2e = report.end_to_end
    assert e2e["identical"] == e2e["speculative_equals_plain"] == e2e["cases"] == 4, e2e
