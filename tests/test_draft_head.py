"""The drafter's LM head over only the drafts a verify uses (contract.DRAFT_INDEX).

draft_block takes `draft_index` [n] and scores those draft positions only: parity with the
PyTorch module at several n (and with the full head's first n rows), lossless speculative
decoding when the controller verifies short blocks (the draft calls then score fewer than K-1),
and an export made before the input (Manifest.draft_index absent) still loads and runs.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from runtime_cases import CASES, artifact, cached, prompts

from dflash_export.export import graphs as G
from dflash_export.models import Drafter, Target
from dflash_export.models.draft_config import DraftConfig
from dflash_export.runtime import contract as C
from dflash_export.runtime.calibrate import cost_model, round_costs
from dflash_export.runtime.controller import Controller, Costs, RowControl, default_costs
from dflash_export.runtime.loop import Request, generate, generate_batch
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.sampling import Sampling

PAIRS = ("qwen3", "qwen2", "llama")  # block 8 (biased), 16 (biased, sliding drafter layer), 4 (tied)


class Short(Controller):
    """Drafts every round, each row verifying a seeded random length in 2..K (its `cap`), as a
    calibrated controller on a MoE target does (runtime/controller.py best_length)."""

    def __init__(self, block_size: int, seed: int):
        super().__init__(default_costs(block_size), block_size)
        self.rng = np.random.default_rng(seed)

    def choose(self, rows, per_row=False):
        for r in rows:
            r.ctl.cap = int(self.rng.integers(2, self.block_size + 1))
        return {id(r): True for r in rows}


def spy(be):
    """The backend, recording in `be.scored` how many drafts each draft_block call returned."""
    call, be.scored = be.draft_block_rows, []

    def draft_block_rows(rows, anchors, scored=None):
        ids, conf = call(rows, anchors, scored)
        be.scored.append(ids.shape[1])
        return ids, conf

    be.draft_block_rows = draft_block_rows
    return be


def full_head(be):
    """The backend with every draft call scoring all K-1 drafts, whatever the loop asks."""
    call = be.draft_block_rows
    be.draft_block_rows = lambda rows, anchors, scored=None: call(rows, anchors)
    return be


def sampled_short(make, n: int = 3) -> None:
    """Sampled rows (rejection sampling against the draft logits) under random short verifies: the
    same tokens with the head over the drafts used as with every draft scored (q read from the
    [rows, n, V] logits), batch 1 and 3."""
    be, ref = make(), full_head(make())
    V, K = be.manifest.vocab_size, be.manifest.block_size
    reqs = [Request(p, 24, Sampling(0.9, seed=i), stop_token_ids=()) for i, p in enumerate(prompts(n, V, seed=9))]
    assert be.samples_drafts
    for i, q in enumerate(reqs):
        kw = dict(sampling=q.sampling, stop_token_ids=())
        assert generate(be, q.prompt, 24, control=Short(K, i), **kw).tokens == \
            generate(ref, q.prompt, 24, control=Short(K, i), **kw).tokens
    assert min(be.scored) < K - 1
    be3, ref3 = make(max_batch=3), full_head(make(max_batch=3))
    got = [g.tokens for g in generate_batch(be3, reqs, control=Short(K, 7))[0]]
    assert got == [g.tokens for g in generate_batch(ref3, reqs, control=Short(K, 7))[0]]
    assert min(be3.scored) < K - 1


def _spy(out, **kw):
    return spy(OrtBackend(out, threads=1, **kw))


def lossless_short(be1, be3, seed: int) -> list[int]:
    """Random short verifies (Short) on 5 prompts, batch 1 on be1 and batch 3 on be3: the target's own
    greedy tokens, each draft call scoring its round's longest verify's drafts; the verify lengths."""
    K, V = be1.manifest.block_size, be1.manifest.vocab_size
    ps = prompts(5, V, seed=seed)
    new = [int(n) for n in np.random.default_rng(seed).integers(8, 40, len(ps))]
    refs = [generate(be1, p, n, draft=False, stop_token_ids=()).tokens for p, n in zip(ps, new)]
    ctl = Short(K, seed=seed)
    verified = []
    for p, n, ref in zip(ps, new, refs):
        be1.scored.clear()
        g = generate(be1, p, n, stop_token_ids=(), control=ctl)
        assert g.tokens == ref
        assert len(be1.scored) == sum(g.drafted)
        assert all(s == v - 1 or v == 1 for s, v in zip(be1.scored, g.verify_lengths)), (be1.scored, g.verify_lengths)
        verified += g.verify_lengths
    be3.scored.clear()
    gens, _ = generate_batch(be3, [Request(p, n, stop_token_ids=()) for p, n in zip(ps, new)],
                             control=Short(K, seed=seed + 1))
    assert [g.tokens for g in gens] == refs
    assert min(be3.scored) < K - 1 and max(be3.scored) <= K - 1
    return verified


@pytest.mark.parametrize("name", PAIRS)
def test_head_over_used_drafts_matches_pytorch(name):
    """The exported graph at n = 1, a middle n and K-1 against the PyTorch module with the same
    draft_index, and against the full head's first n rows: ids equal, logits within 1e-4."""
    tdir, ddir, out = artifact(CASES[name])
    be = OrtBackend(out, threads=1)
    m = be.manifest
    assert m.draft_index and [t.name for t in C.io(C.DRAFT_BLOCK, m)[0]][3] == C.DRAFT_INDEX
    dc = DraftConfig.load(ddir)
    target, drafter = Target.from_pretrained(tdir, dc.target_layer_ids), Drafter.from_pretrained(ddir)
    K, P = m.block_size, 11
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        ids = torch.randint(0, m.vocab_size, (2, P), generator=g)
        ctx = []
        for row in ids:
            _, taps, _ = target(row[None], torch.arange(P)[None], target.empty_kv())
            ctx.append(drafter.context_kv(taps, torch.arange(P)[None]))
    lens = torch.tensor([P, P - 4])  # ragged: row 1 sees 7 context positions
    past = [t.transpose(0, 1).contiguous() for j in range(m.draft_layers)
            for t in (torch.cat([c[j][0] for c in ctx]), torch.cat([c[j][1] for c in ctx]))]
    block = torch.full((2, K), m.mask_token_id)
    block[:, 0] = torch.randint(0, m.vocab_size, (2,), generator=g)
    pos = lens[:, None] + torch.arange(K)
    module = G.wrapper(C.DRAFT_BLOCK, target, drafter, index=True)
    names_in, names_out = C.names(C.DRAFT_BLOCK, m)
    with torch.inference_mode():
        full = module(block, pos, lens, torch.arange(K - 1), *past)
    for n in sorted({1, max(1, (K - 1) // 2), K - 1}):
        index = torch.arange(n)
        inputs = [block, pos, lens, index, *past]
        with torch.inference_mode():
            ref = module(*inputs)
        got = be.sessions[C.DRAFT_BLOCK].run(names_out, {k: v.numpy() for k, v in zip(names_in, inputs)})
        err = float(np.abs(got[1] - ref[1].numpy()).max())
        err_full = float(np.abs(got[1] - full[1][:, :n].numpy()).max())
        conf_err = float(np.abs(got[2] - ref[2].numpy()).max())
        print(f"{name} K={K} n={n}: draft_logits max |onnx - torch| {err:.2e}, vs the full head's first n {err_full:.2e}, "
              f"draft_conf {conf_err:.2e}")
        assert got[1].shape == (2, n, C.draft_vocab_size(m)) and got[0].shape == (2, n)
        assert err < 1e-4 and err_full < 1e-4 and conf_err < 1e-4
        assert (got[0] == ref[0].numpy()).all() and (got[0] == full[0][:, :n].numpy()).all()


@pytest.mark.parametrize("name", PAIRS)
def test_short_verifies_score_fewer_drafts_and_stay_lossless(name):
    """Rounds verifying random lengths 2..K: every draft call scores the round's longest verify's
    drafts only (fewer than K-1 in most rounds), and the output is the target's own greedy decoding,
    batch 1 and batch 3."""
    _, _, out = artifact(CASES[name])
    verified = lossless_short(_spy(out), _spy(out, max_batch=3), 21)
    K = CASES[name].block
    assert sum(v < K for v in verified) > len(verified) // 2  # mostly short verifies: the head shrank


@pytest.mark.filterwarnings("ignore:Context managers for TensorRT types are deprecated")
def test_sampled_rows_read_the_scored_logits():
    _, _, out = artifact(CASES["qwen3"])
    sampled_short(lambda **kw: _spy(out, **kw))


def test_draft_only_quantized_head_scores_the_drafts_used(tmp_path):
    """quantize --draft-only: the drafter's own head copy (MatMulNBits) reads the gathered hidden
    states, and short verifies stay lossless (batch 1 and 3) and sample as with every draft scored."""
    import onnx
    from click.testing import CliRunner

    from dflash_export.cli import cli

    _, _, src = artifact(CASES["qwen3"])
    out = tmp_path / "q"
    r = CliRunner().invoke(cli, ["quantize", str(src), "--out", str(out), "--quantize", "int4", "--draft-only", "--quiet"])
    assert r.exit_code == 0, r.output
    g = onnx.load(out / "draft_block.onnx", load_external_data=False).graph
    assert C.DRAFT_INDEX in [i.name for i in g.input]
    made = {o: n for n in g.node for o in n.output}
    head = [n for n in g.node if n.op_type == "MatMulNBits" and any("lm_head" in i for i in n.input)]
    assert head and made[head[0].input[0]].op_type == "Gather"  # the head sees the picked positions only
    lossless_short(_spy(out), _spy(out, max_batch=3), 41)
    sampled_short(lambda **kw: _spy(out, **kw), n=2)


@pytest.mark.filterwarnings("ignore:Context managers for TensorRT types are deprecated")
def test_tensorrt_engines_take_the_head_length(monkeypatch, tmp_path):
    """The TensorRT build profiles draft_index over 1..K-1 (the bindings double: shapes checked
    against the profile, ONNX Runtime playing the engine); short verifies stay lossless on the
    engines at batch 1 and 3, their draft calls scoring fewer drafts."""
    import trt_fake
    from click.testing import CliRunner

    from dflash_export.cli import cli
    from dflash_export.runtime.manifest import load_manifest
    from dflash_export.runtime.trt.backend import TensorRTBackend

    trt_fake.install(monkeypatch)
    out = tmp_path / "out"
    shutil.copytree(artifact(CASES["qwen3"])[2], out)
    r = CliRunner().invoke(cli, ["build", str(out), "--max-context", "128", "--max-prompt", "48", "--max-batch", "3",
                                 "--timing-cache", str(tmp_path / "tc"), "--no-progress"])
    assert r.exit_code == 0, r.output
    K = load_manifest(out).block_size
    shapes = load_manifest(out).engines["profiles"][C.DRAFT_BLOCK][0]["shapes"][C.DRAFT_INDEX]
    assert shapes == [[1], [K - 1], [K - 1]]
    lossless_short(spy(TensorRTBackend(out)), spy(TensorRTBackend(out, max_batch=3)), 31)


def test_an_export_without_draft_index_still_runs(tmp_path):
    """An artifact of the older contract (exported without the input: Manifest.draft_index absent)
    loads, its draft calls score all K-1 drafts whatever the loop asks, short verifies stay
    lossless, and `check` checks its graphs as they are; its manifest reads as the older exports' did."""
    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.manifest import load_manifest

    tdir, ddir, _ = artifact(CASES["llama"])

    def build(tmp):
        export_artifact(tdir, ddir, tmp / "out", max_context=CASES["llama"].max_context, progress=False,
                        draft_index=False)
        raw = json.loads((tmp / "out" / "manifest.json").read_text())
        assert raw.pop("draft_index") is False
        (tmp / "out" / "manifest.json").write_text(json.dumps(raw))  # what an export before the field wrote

    old = tmp_path / "old"
    shutil.copytree(cached("llama-without-draft-index", "draft_index=False", build) / "out", old)
    m = load_manifest(old)
    assert not C.draft_index(m) and C.DRAFT_INDEX not in C.names(C.DRAFT_BLOCK, m)[0]
    assert C.DRAFT_INDEX not in [t.name for t in m.graphs[C.DRAFT_BLOCK].inputs]
    be = _spy(old)
    K = m.block_size
    for i, p in enumerate(prompts(3, m.vocab_size, seed=7)):
        ref = generate(be, p, 20, draft=False, stop_token_ids=()).tokens
        be.scored.clear()
        assert generate(be, p, 20, stop_token_ids=(), control=Short(K, seed=i)).tokens == ref
        assert set(be.scored) == {K - 1}
    from dflash_export.export.check import run_check

    report = run_check(old, tdir, ddir, prompts=2, max_new_tokens=8, progress=False)  # its graphs as they are
    assert report.passed and any(r.graph == C.DRAFT_BLOCK for r in report.rows), report.notes


def test_calibrated_costs_price_the_head_by_length():
    """bench --calibrate's round costs time a draft call scoring one draft beside the full one
    (`draft_one_ms`); the controller then charges a round verifying s positions the head of s - 1
    drafts, and so verifies shorter where the head is a large share of the draft call."""
    _, _, out = artifact(CASES["qwen3"])
    be = OrtBackend(out, threads=1)
    c = round_costs(be, list(range(3, 20)), 1, repeats=3)
    assert c["draft_one"] > 0 and c["draft"] > 0
    costs = Costs.from_json(cost_model({1: c}))
    assert costs.draft_one == [c["draft_one"]]
    K = 16  # a MoE-like target (verify cost growing with its length), a draft call mostly its head
    verify = [[1.0 + 0.15 * (s - 1) for s in range(1, K + 1)]]
    flat, sliced = Costs([1], [1.0], verify, [1.7], [0.01]), Costs([1], [1.0], verify, [1.7], [0.01], draft_one=[0.3])
    assert sliced.draft_ms(1, K) == 1.7 and sliced.draft_ms(1, 2) == 0.3 and abs(sliced.draft_ms(1, 9) - 1.0) < 1e-9
    row = RowControl(emitted=4.7, weight=1.0, length=16.0)
    s_flat, s_sliced = (Controller(c_, K).best_length(row, 1, False)[0] for c_ in (flat, sliced))
    print(f"best verify length: draft at full cost {s_flat}, head priced by length {s_sliced}")
    assert s_sliced < s_flat
