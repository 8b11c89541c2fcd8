"""Sampling (T = 0.8) with a DFlash 2 drafter, on a pair briefly trained in the tests
(tests/dflash2_trained.py: the official z-lab drafter class fitted to the target's samples with
the official forward, exported with this checkout):

- the deployed loop (ONNX Runtime) equals the PyTorch oracle (models/generate_dflash2.py) seed
  for seed, rejection, compare and greedy;
- the deployed loop's first three tokens follow the target's exact distribution (chi-square),
  and the same statistic rejects the output of a rejection rule fed a wrong q (the test can fail);
- its mean acceptance is at least 0.95x the official reference's own sampling loop
  (`dflash_generate` at the same temperature) on the same pair, prompts and seeds.
The long acceptance run is bench/dflash2.py --acceptance.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from dflash2_trained import MASK, TEMP, V, trained_export
from test_oracle import _chi2_p

from dflash_export.models import Target
from dflash_export.models.dflash2 import DFlash2Drafter
from dflash_export.models.generate_dflash2 import dflash2_generate
from dflash_export.runtime import walk
from dflash_export.runtime.load import open_backend
from dflash_export.runtime.loop import Request, generate, generate_batch
from dflash_export.runtime.sampling import Drafted, Sampling, probabilities

torch.set_num_threads(1)
dm = pytest.importorskip("dflash.model", reason="the official z-lab package `dflash` 0.1.0 is not installed")


@pytest.fixture(scope="module")
def trained():
    return trained_export()


def test_deployed_loop_is_the_oracle_seed_for_seed(trained):
    """Tolerance: ORT and PyTorch scores differ in the last float32 bits and both sample in float64
    from the same uniforms; a draw within ~1e-6 of a CDF or accept boundary could differ (none of
    these seeds does)."""
    target = Target.from_pretrained(trained / "t", [0, 1])
    ours = DFlash2Drafter.from_pretrained(trained / "d")
    be = open_backend(trained / "out", "ort", "cpu")
    accepted = 0
    for seed in range(8):
        prompt = np.random.default_rng(seed).integers(0, V, 3 + seed % 4).tolist()
        for s in (Sampling(TEMP, seed=seed), Sampling(TEMP, seed=seed, method="compare"), Sampling(seed=seed)):
            kw = dict(sampling=s)
            g = generate(be, prompt, 30, stop_token_ids=(), **kw)
            o = dflash2_generate(target, ours, prompt, 30, mask_token_id=MASK, **kw)
            assert g.tokens == o.tokens and g.acceptance_lengths == o.acceptance_lengths, (seed, kw)
            accepted += sum(a - 1 for a in g.acceptance_lengths)
    assert accepted > 100


def _exact_joint(hf, prompt: list[int]) -> np.ndarray:
    """P(t1, t2, t3) [V,V,V] of the target sampled at TEMP, from three batched forwards."""
    def next_probs(seqs):
        with torch.no_grad():
            return probabilities(hf(torch.tensor(seqs), use_cache=False).logits[:, -1].numpy(), Sampling(TEMP))

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(V)])
    p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def test_output_is_the_target_distribution(trained, monkeypatch):
    """2,000 sampled requests through the batched loop: chi-square of the first token, the third,
    and the pairs (1,2), (2,3) against the exact law (p >= 1e-3 each); the block covers tokens 2-4,
    so tokens 2 and 3 come from the drafted round. Control: the same requests with q halved in
    the accept test (drafts accepted too often) are rejected (p < 1e-6)."""
    from dflash_export.models.tiny import hf_model

    prompt, n = [1, 2, 3], 2000
    be = open_backend(trained / "out", "ort", "cpu", max_batch=64)
    exact = _exact_joint(hf_model(trained / "t"), prompt)
    views = {(0,): (1, 2), (2,): (0, 1), (0, 1): (2,), (1, 2): (0,)}

    def pvalues() -> tuple[dict, float]:
        reqs = [Request(prompt, 3, Sampling(TEMP, seed=s), stop_token_ids=()) for s in range(n)]
        gens, _ = generate_batch(be, reqs, batch=64)
        x = np.array([g.tokens for g in gens])
        drafts = sum(g.acceptance_lengths[0] > 1 for g in gens)
        out = {}
        for cols, other in views.items():
            idx = np.ravel_multi_index(tuple(x[:, c] for c in cols), (V,) * len(cols))
            out[cols] = _chi2_p(np.bincount(idx, minlength=V ** len(cols)).astype(float),
                                n * exact.sum(other).ravel())
        return out, drafts / n

    right, accepted = pvalues()
    sample_walk = walk.sample_walk
    monkeypatch.setattr(walk, "sample_walk", lambda *a: (lambda d: Drafted(d.tokens, d.q, d.qx * 0.5, d.ids))(sample_walk(*a)))
    wrong, wrong_accepted = pvalues()
    print(f"chi-square p-values {right}, first rounds with a draft accepted {accepted:.2f}; "
          f"with q halved in the accept test: {wrong} ({wrong_accepted:.2f})")
    assert accepted > 0.3, "drafts should often be accepted, or the rejection rule is barely under test"
    assert min(right.values()) >= 1e-3, right
    assert min(wrong.values()) < 1e-6, wrong


def test_acceptance_matches_the_official_sampling_loop(trained, monkeypatch):
    """Mean acceptance length (tokens per round) of the deployed loop >= 0.95x the official
    `dflash_generate`'s at T = 0.8, same pair, prompts and seeds (its own randomness, seeded
    with torch.manual_seed)."""
    from dflash_export.models.tiny import hf_model

    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # its stats time with CUDA syncs; no GPU here
    official = dm.DFlash2DraftModel.from_pretrained(str(trained / "d"), dtype=torch.float32).eval()
    hf = hf_model(trained / "t")
    be = open_backend(trained / "out", "ort", "cpu", max_batch=32)
    seeds, new = 64, 48
    prompts = [np.random.default_rng(100 + s).integers(0, V, 3 + s % 5).tolist() for s in range(seeds)]
    gens, _ = generate_batch(be, [Request(p, new, Sampling(TEMP, seed=s), stop_token_ids=())
                                  for s, p in enumerate(prompts)], batch=32)
    ours = [a for g in gens for a in g.acceptance_lengths]
    ref = []
    for s, p in enumerate(prompts):
        torch.manual_seed(s)
        ref += dm.dflash_generate(official, hf, torch.tensor([p]), new, None, temperature=TEMP,
                                  return_stats=True).acceptance_lengths
    se = np.hypot(np.std(ours) / np.sqrt(len(ours)), np.std(ref) / np.sqrt(len(ref)))
    ratio = np.mean(ours) / np.mean(ref)
    print(f"mean acceptance: ours {np.mean(ours):.3f} over {len(ours)} rounds, official {np.mean(ref):.3f} over "
          f"{len(ref)}; ratio {ratio:.3f} (standard error of the difference {se:.3f})")
    assert np.mean(ours) > 1.5, "the trained drafter should get drafts accepted"
    assert ratio >= 0.95
