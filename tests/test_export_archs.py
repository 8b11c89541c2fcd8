"""Qwen2 and Qwen3 targets at block size 16, then `check` (20 prompts) and the taps.

The pairs are the shared runtime_cases.CASES (exported once per content, as the runtime
tests use them): Qwen2 (q/k/v bias) with a 3-layer drafter whose layer 1 slides (window 6
< block 16: a masked block graph); Qwen3 (q/k norms, untied) with a 1-layer drafter tapping
the target's last layer. The CLI export itself (progress, --force, tokenizer, --block-size
over the drafter's own, a qwen2 last-layer tap) is checked on test_draft_vocab.py's export.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tiny_exports import exported_taps_error
from runtime_cases import CASES, artifact

from dflash_export.cli import cli
from dflash_export.models.draft_config import DraftConfig
from dflash_export.runtime import contract as C, manifest as M

PAIRS = {"qwen2": "qwen2", "qwen3": "qwen3-b16"}  # arch -> CASES name


@pytest.fixture(scope="module", params=sorted(PAIRS))
def art(request):
    case = CASES[PAIRS[request.param]]
    return request.param, case, *artifact(case)


def test_manifest(art):
    arch, case, target, draft, out = art
    m = M.load_manifest(out)
    assert m.block_size == 16 and m.max_context == case.max_context
    assert m.architecture == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert m.graphs[C.DRAFT_BLOCK].inputs[0].shape == ["batch", 16]
    assert m.graphs[C.DRAFT_BLOCK].outputs[1].shape == ["batch", "scored", m.vocab_size]  # the drafts a verify uses
    assert len(m.graphs[C.TARGET].inputs) == 4 + 2 * m.target_layers  # + past_lengths, logits_index
    assert len(m.graphs[C.DRAFT_BLOCK].inputs) == 4 + 2 * m.draft_layers  # + ctx_lengths, draft_index
    ctx = [f"ctx_{kv}.{j}" for j in range(m.draft_layers) for kv in ("key", "value")]
    assert [x.name for x in m.graphs[C.DRAFT_CONTEXT].outputs] == ctx
    windows = [DraftConfig.load(draft).layer_window(j) for j in range(m.draft_layers)]
    assert windows == [None if j != 1 or not case.sliding else case.sliding for j in range(m.draft_layers)]


def test_check_passes(art):
    _, _, target, draft, out = art
    r = CliRunner().invoke(cli, ["check", str(out), "--target", str(target), "--draft", str(draft),
                                 "--num-prompts", "20", "--max-new-tokens", "20", "--json"])
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["passed"], r.stdout
    e2e = report["end_to_end"]
    assert e2e["identical"] == e2e["cases"] == 20 and e2e["acceptance_identical"] == 20
    assert sum(e2e["acceptance_histogram"]) > 20 and len(e2e["acceptance_histogram"]) == 16
    for rows in report["graphs"].values():
        assert all(row["passed"] for row in rows)


def test_exported_taps_are_transformers_hidden_states(art):
    """Every tap id; the target's last layer (post-final-norm in transformers) in qwen3's."""
    arch, _, target, draft, out = art
    m = M.load_manifest(out)
    if arch == "qwen3":
        assert m.target_layers - 1 in m.target_layer_ids
    err = exported_taps_error(out, target)
    print(f"{arch}: taps {m.target_layer_ids} of {m.target_layers} layers, max abs error {err:.2e}")
    assert err <= 1e-4
