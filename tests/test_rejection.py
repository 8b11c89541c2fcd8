"""Rejection sampling and the drafter's logit transforms against the official z-lab reference.

The reference is the `dflash` package's `dflash/model.py` (0.1.0, installed with --no-deps
by `make setup`): its `_sampling_probs`, `_rejection_sample` and `compute_logits` run here
on the same inputs as ours. The reference draws its randomness with torch.rand_like and
torch.multinomial; the rule test feeds it our uniforms instead, so the two must agree draw
for draw, not only in distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_export.models import Target, new_drafter
from dflash_export.models.draft_config import DraftConfig
from dflash_export.models.drafter import Drafter
from dflash_export.runtime.sampling import Drafted, Sampling, inverse_cdf, probabilities, rejection, sample_drafts
from dflash_export.models.tiny import make_target

import dflash.model as ref  # noqa: E402  (make setup installs it: dflash 0.1.0, --no-deps)


@pytest.mark.parametrize("kw", [dict(), dict(top_k=7), dict(top_p=0.7), dict(top_k=12, top_p=0.5)])
def test_probabilities_are_the_reference_sampling_probs(kw):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 3
    ours = probabilities(logits.numpy(), Sampling(0.8, **kw))
    theirs = ref._sampling_probs(logits, 0.8, kw.get("top_p", 1.0), kw.get("top_k", 0)).double().numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_rejection_rule_is_the_reference_draw_for_draw(monkeypatch):
    """Random p, q, drafts (full and reduced draft vocabulary): ours and the reference's
    `_rejection_sample` fed the same uniforms give the same accepted count and next token."""
    rng = np.random.default_rng(0)
    V, m, seen = 30, 6, set()
    for trial in range(300):
        ids = np.sort(rng.choice(V, 12, replace=False)) if trial % 3 == 0 else None
        p = probabilities(rng.normal(size=(m + 1, V)) * 2, Sampling(1.0))
        q_logits = rng.normal(size=(m, V if ids is None else len(ids))) * 2
        if trial % 2:  # drafts that resemble the target: long acceptances
            q_logits = np.log(p[:m] + 1e-9)[:, ids if ids is not None else slice(None)] + rng.normal(size=q_logits.shape) * 0.3
        ud, ua, ut = rng.random(m), rng.random(m), rng.random(m + 1)
        d = sample_drafts(q_logits, ud, Sampling(1.0), ids=ids)
        a, tok = rejection(d, m, p, ua, ut)

        draws = iter(ut[a : a + 1])
        monkeypatch.setattr(torch, "rand_like", lambda x: torch.tensor(ua[None], dtype=x.dtype))
        monkeypatch.setattr(ref, "_sample_probs",
                            lambda pr: torch.from_numpy(inverse_cdf(pr.double().numpy().reshape(1, -1), [next(draws)])))
        tp = torch.from_numpy(p)[None]
        if ids is None:
            ra, rtok = ref._rejection_sample(torch.from_numpy(d.tokens)[None], tp, torch.from_numpy(d.q)[None])
        else:
            di = torch.from_numpy(ids).expand(m, -1)[None]
            ra, rtok = ref._rejection_sample(torch.from_numpy(d.tokens)[None], tp, torch.from_numpy(d.q)[None], di)
        monkeypatch.undo()
        assert (a, tok) == (int(ra), int(rtok)), trial
        seen.add(a)
    assert {0, m} <= seen and len(seen) > 4  # rejections at the start, in the middle, full blocks


def _pair(tmp_path, **knobs):
    d = make_target(tmp_path / "t", arch="qwen3", seed=3, layers=3)
    target = Target.from_pretrained(d, tap_ids=[0, 2])
    torch.manual_seed(1)
    drafter = new_drafter(target.config, num_layers=2, target_layer_ids=[0, 2], block_size=5, mask_token_id=99)
    cfg = dict(drafter.config.raw)
    cfg["dflash_config"] = {**cfg["dflash_config"], **knobs}
    with_knobs = Drafter(DraftConfig.from_dict(cfg)).eval()
    with_knobs.load_state_dict(drafter.state_dict())
    return target, drafter.eval(), with_knobs, cfg


@torch.no_grad()
def test_drafter_transforms_are_the_reference(tmp_path):
    """output_multiplier, final_logit_softcapping and input_embedding_scale: our draft logits
    equal the reference drafter's `compute_logits` over the same weights (and without the
    keys our logits are today's)."""
    import transformers

    knobs = dict(output_multiplier=0.7, final_logit_softcapping=2.5, input_embedding_scale=1.8)
    target, plain, drafter, cfg = _pair(tmp_path, **knobs)
    theirs = ref.DFlashDraftModel(transformers.Qwen3Config(**cfg)).eval()
    missing, unexpected = theirs.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)

    prompt = torch.tensor([[5, 17, 3, 44, 8, 61, 2]])
    n, k = prompt.shape[1], 5
    _, taps, _ = target(prompt, torch.arange(n)[None], target.empty_kv())
    block = torch.tensor([[12] + [99] * (k - 1)])
    pos = torch.arange(n, n + k)[None]
    ours = drafter.draft_logits(target, block, pos, drafter.context_kv(taps, torch.arange(n)[None]))
    class _Head:  # what the reference reads from a transformers model
        def get_input_embeddings(self):
            return target.model.embed_tokens

    emb = ref._raw_input_embeddings(_Head(), block, float(ref._draft_value(theirs.config, "input_embedding_scale")))
    hidden = theirs(target_hidden=taps, noise_embedding=emb, position_ids=torch.arange(n + k)[None])[:, 1:]
    want = theirs.compute_logits(hidden, target.lm_head)
    err = (ours - want).abs().max().item()
    print(f"transformed draft logits vs the reference: max abs error {err:.2e}")
    assert err < 1e-4 and want.abs().max() <= 2.5
    base = plain.draft_logits(target, block, pos, plain.context_kv(taps, torch.arange(n)[None]))
    assert (base - ours).abs().max() > 0.1  # the knobs change the logits ...
    assert plain.transform_logits(base) is base  # ... and without them nothing is applied


def test_a_wrong_q_is_caught():
    """The rule's check: with q off by a factor in the accept test, the emitted token's
    distribution is no longer p (exact enumeration over one draft position)."""
    rng = np.random.default_rng(3)
    V = 6
    p = probabilities(rng.normal(size=(2, V)), Sampling(1.0))
    q_logits = rng.normal(size=(1, V))

    def law(scale: float) -> np.ndarray:
        n, out = 40000, np.zeros(V)
        u = np.random.default_rng(4).random((n, 3))
        for ud, ua, ut in u:
            d = sample_drafts(q_logits, [ud], Sampling(1.0))
            d = Drafted(d.tokens, d.q, d.qx * scale)
            a, tok = rejection(d, 1, p, [ua], [ut, ut])
            out[d.tokens[0] if a else tok] += 1
        return out / n

    right, wrong = law(1.0), law(0.5)
    print(f"max |law - p|: right q {np.abs(right - p[0]).max():.4f}, q/2 {np.abs(wrong - p[0]).max():.4f}")
    assert np.abs(right - p[0]).max() < 0.01 < np.abs(wrong - p[0]).max()


def test_exported_drafter_applies_the_transforms_and_samples_like_the_oracle(tmp_path):
    """A drafter whose config sets the three keys, exported: the block graph's draft logits
    are the oracle's (the export's own validation) and the runtime's sampled output equals the
    oracle's at T = 0.8 (rejection and compare) and greedy, seed for seed.

    Tolerance: the two compute q and p from float32 logits that differ in the last bits (ORT
    vs PyTorch), then sample in float64 from the same uniforms; a draw within ~1e-6 of a CDF
    or accept boundary could differ. None of these seeds does; a failure that names one seed
    and a near-boundary draw would be that, not a bug (the rule itself is tested draw for draw
    above and by chi-square in test_oracle)."""
    import json

    from dflash_export.export.artifact import export_artifact
    from dflash_export.models import speculative_generate
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.models.tiny import make_drafter

    t = make_target(tmp_path / "t", arch="qwen3", seed=5, layers=2, vocab=64)
    d = make_drafter(tmp_path / "d", t, layers=1, block_size=5)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"].update(output_multiplier=1.6, final_logit_softcapping=4.0, input_embedding_scale=0.6)
    (d / "config.json").write_text(json.dumps(cfg))
    m = export_artifact(t, d, tmp_path / "out", max_context=96, progress=False)
    be = OrtBackend(tmp_path / "out")
    drafter = Drafter.from_pretrained(d)
    assert drafter.config.final_logit_softcapping == 4.0 and be.samples_drafts
    target = Target.from_pretrained(t, drafter.config.target_layer_ids)
    rng = np.random.default_rng(2)
    accepted = 0
    for seed in range(6):
        prompt = rng.integers(0, 62, 5 + seed).tolist()
        for s in (Sampling(seed=seed), Sampling(0.8, seed=seed), Sampling(0.8, seed=seed, method="compare")):
            kw = dict(sampling=s, stop_token_ids=())
            g = generate(be, prompt, 24, **kw)
            o = speculative_generate(target, drafter, prompt, 24, mask_token_id=m.mask_token_id, block_size=5, **kw)
            assert g.tokens == o.tokens and g.acceptance_lengths == o.acceptance_lengths, (seed, kw)
            accepted += sum(a - 1 for a in g.acceptance_lengths)
    assert accepted > 0
