"""Qwen3 and Qwen2 targets at block size 16: exported through the CLI, then `check` (20 prompts).

Qwen3 (q/k norms, untied) gets a 3-layer drafter made for block 4, with a sliding-window
layer (causal, window 5: a masked block graph), exported with `--block-size 16`; Qwen2
(q/k/v bias) a 1-layer drafter at block 16.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dflash_export.testing import exported_taps_error, make_drafter, make_target

from dflash_export.cli import cli
from dflash_export.runtime import contract as C, manifest as M

CASES = {
    "qwen3": dict(target=dict(layers=3), args=["--block-size", "16"],
                  draft=dict(layers=3, block_size=4, target_layer_ids=[0, 1, 2], sliding_window=5,
                             layer_types=["full_attention", "sliding_attention", "full_attention"])),
    "qwen2": dict(target=dict(layers=2, hidden=32, heads=4, kv_heads=2), draft=dict(layers=1, block_size=16), args=[]),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def art(request, tmp_path_factory):
    case = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    target = make_target(d / "target", request.param, **case["target"])
    draft = make_drafter(d / "draft", target, **case["draft"])
    out = d / "out"
    r = CliRunner().invoke(cli, ["export", "--target", str(target), "--draft", str(draft), "--out", str(out),
                                 "--max-context", "512", *case["args"]])
    assert r.exit_code == 0, r.output
    assert "done" in r.stderr and "validate" in r.stderr and "total" in r.stderr  # progress + sizes
    return request.param, target, draft, out


def test_manifest(art):
    arch, target, draft, out = art
    m = M.load_manifest(out)
    assert m.block_size == 16 and m.max_context == 512
    assert m.architecture == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert m.graphs[C.DRAFT_BLOCK].inputs[0].shape == ["batch", 16]
    assert m.graphs[C.DRAFT_BLOCK].outputs[1].shape == ["batch", 15, m.vocab_size]
    assert len(m.graphs[C.TARGET].inputs) == 2 + 2 * m.target_layers
    assert len(m.graphs[C.DRAFT_BLOCK].inputs) == 2 + 2 * m.draft_layers


def test_check_passes(art):
    _, target, draft, out = art
    r = CliRunner().invoke(cli, ["check", str(out), "--target", str(target), "--draft", str(draft),
                                 "--prompts", "20", "--max-new-tokens", "20", "--json"])
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["passed"], r.stdout
    e2e = report["end_to_end"]
    assert e2e["identical"] == e2e["cases"] == 20 and e2e["acceptance_identical"] == 20
    assert sum(e2e["acceptance_histogram"]) > 20 and len(e2e["acceptance_histogram"]) == 16
    for rows in report["graphs"].values():
        assert all(row["passed"] for row in rows)


def test_exported_taps_are_transformers_hidden_states(art):
    """Every tap id, the target's last layer included (post-final-norm in transformers)."""
    arch, target, draft, out = art
    m = M.load_manifest(out)
    assert m.target_layers - 1 in m.target_layer_ids
    err = exported_taps_error(out, target)
    print(f"{arch}: taps {m.target_layer_ids} of {m.target_layers} layers, max abs error {err:.2e}")
    assert err <= 1e-4
