"""DFlash 2 drafters exported and run: tiny random drafters made with the official z-lab classes
(tests/test_dflash2.py's `official_drafter`), exported with a tiny target, `check`ed against
PyTorch, and decoded by the runtime's batched loop on ONNX Runtime: greedy tokens equal the
target's plain greedy output and every full-block round accepts as many drafts as the official
reference's own generation loop.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from runtime_cases import _bias_target, prompts
from test_dflash2 import CASES, _official, official_drafter

from dflash_export.models import Target, autoregressive_generate
from dflash_export.testing import hf_model, make_target

torch.set_num_threads(1)
EXPORTED = ("sliding-b8-softcap", "mixed-b6-noncausal")  # sliding causal + softcap; sliding/full non-causal


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = make_target(tmp_path_factory.mktemp("t") / "t", "qwen3", layers=3, seed=4, tie=False)
    _bias_target(d, 1.4)
    return d, hf_model(d), Target.from_pretrained(d, [0, 2])


@pytest.fixture(scope="module")
def exports(pair, tmp_path_factory):
    """name -> (official model, drafter dir, export dir); one export per case, shared by the tests."""
    from dflash_export.export.artifact import export_artifact

    tdir, _, target = pair
    out = {}
    for name in EXPORTED:
        root = tmp_path_factory.mktemp(name)
        official, ddir = official_drafter(root / "d", target.config, CASES[name])
        export_artifact(tdir, ddir, root / "out", max_context=128, progress=False)
        out[name] = (official, ddir, root / "out")
    return out


@pytest.mark.parametrize("name", EXPORTED)
def test_check_passes(pair, exports, name):
    """`check`: every graph output (candidates and walk scores included) within 1e-4 of PyTorch,
    ragged rows too, and the deployed loop equal to the DFlash 2 oracle token for token and
    round for round."""
    from dflash_export.export.check import run_check
    from dflash_export.runtime import contract as C

    tdir = pair[0]
    _, ddir, art = exports[name]
    report = run_check(art, tdir, ddir, prompts=6, max_new_tokens=20, progress=False)
    block = [r for r in report.rows if r.graph == C.DRAFT_BLOCK]
    names = {r.output for r in block}
    assert {C.DRAFT_IDS, C.DRAFT_CANDIDATES, C.DRAFT_SCORES, C.DRAFT_CONF} <= names, names
    worst = max(r.max_abs for r in block if r.max_abs is not None)
    print(f"{name}: draft_block worst |onnx - pytorch| = {worst:.2e} (tolerance 1e-4) over {len(block)} rows")
    assert report.passed, [r for r in report.rows if not r.passed]
    e2e = report.end_to_end
    assert e2e["identical"] == e2e["acceptance_identical"] == e2e["cases"] == 6, e2e


def test_batched_loop_equals_the_official(pair, exports, monkeypatch):
    """Batch 3 on ONNX Runtime: each row's tokens = the target's own greedy; every full-block
    round's acceptance length = the official z-lab loop's on the same drafter."""
    from dflash_export.runtime.load import open_backend
    from dflash_export.runtime.loop import Request, generate_batch

    dm = _official()
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # its stats time with CUDA syncs; no GPU here
    _, hf, target = pair
    compared = accepted = 0
    for name in EXPORTED:
        official, _, art = exports[name]
        k = CASES[name]["block"]
        backend = open_backend(art, "ort", "cpu", max_batch=3)
        ps = prompts(5, target.config.vocab_size, seed=20)
        reqs = [Request(p, 20 + 3 * i, stop_token_ids=()) for i, p in enumerate(ps)]
        gens, _ = generate_batch(backend, reqs, batch=3)
        for p, r, g in zip(ps, reqs, gens):
            plain = autoregressive_generate(target, p, r.max_new_tokens).tokens
            assert g.tokens == plain, name
            ref = dm.dflash_generate(official, hf, torch.tensor([p]), r.max_new_tokens, None, return_stats=True)
            start = len(p)
            for a, b in zip(g.acceptance_lengths, ref.acceptance_lengths):
                if start + k > len(p) + r.max_new_tokens:  # the official loop drafts a shorter last block
                    break
                assert a == b, (name, g.acceptance_lengths, ref.acceptance_lengths)
                compared += 1
                accepted += a > 1
                start += a
    print(f"{compared} full-block rounds equal to the official, {accepted} with accepted drafts")
    assert compared >= 20 and accepted >= 5


def test_manifest_and_contract(exports):
    from dflash_export.runtime import contract as C, manifest as M

    _, _, art = exports["sliding-b8-softcap"]
    m = M.load_manifest(art)
    assert m.selector == {"top_k": 4, "rank": 8, "conv_kernel": 2, "conv_group": 16}
    outs = [t.name for t in C.io(C.DRAFT_BLOCK, m)[1]]
    assert outs[-2:] == [C.DRAFT_CANDIDATES, C.DRAFT_SCORES]
    shapes = {t.name: t.shape for t in m.graphs[C.DRAFT_BLOCK].outputs}
    assert shapes[C.DRAFT_SCORES][1:] == [7, 4, 4] and shapes[C.DRAFT_CANDIDATES][1:] == [7, 4]
    assert np.isfinite(m.block_size)
