"""The drafter's context ring with a DFlash (1) drafter whose layers all slide: exported with a
window far shorter than the context, decoded by the deployed loop (ONNX Runtime, batch 1 and
batched) on prompts and generations that run well past the window. Greedy tokens equal the
target's own greedy output, and every round accepts as many drafts as the PyTorch oracle, whose
drafter cache keeps every position (so the ring drops nothing a query could see)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_cases import _bias_target, cached

from dflash_export.models import Target, autoregressive_generate, speculative_generate
from dflash_export.models.drafter import Drafter

torch.set_num_threads(1)
WINDOW, MAX_CONTEXT = 8, 112
# a biased target and a drafter with sharpened v/o projections: drafts get accepted and depend on
# the context the window keeps (the last assertion)
RECIPE = dict(bias=1.2, vo_std=0.35, window=WINDOW, max_context=MAX_CONTEXT, block=6)


@pytest.fixture(scope="module")
def ring_export() -> Path:
    from dflash_export.export.artifact import export_artifact
    from dflash_export.models.tiny import make_drafter, make_target

    def build(tmp: Path) -> None:
        make_target(tmp / "t", "qwen3", seed=4, layers=3, hidden=48, heads=4, kv_heads=2, head_dim=16, intermediate=96)
        _bias_target(tmp / "t", RECIPE["bias"])
        make_drafter(tmp / "d", tmp / "t", layers=2, block_size=RECIPE["block"], seed=2, target_layer_ids=[0, 2],
                     layer_types=["sliding_attention"] * 2, sliding_window=WINDOW)
        d = Drafter.from_pretrained(tmp / "d")
        with torch.no_grad():
            for name, p in d.named_parameters():
                if "v_proj" in name or "o_proj" in name:
                    p.normal_(0.0, RECIPE["vo_std"])
        d.save_pretrained(tmp / "d")
        export_artifact(tmp / "t", tmp / "d", tmp / "out", max_context=MAX_CONTEXT, progress=False)
    return cached("dflash1-ring", repr(sorted(RECIPE.items())), build)


def test_ring_decodes_like_the_unbounded_oracle(ring_export):
    from dflash_export.runtime import manifest as M, prefix
    from dflash_export.runtime.load import open_backend
    from dflash_export.runtime.loop import Request, generate, generate_batch

    m = M.load_manifest(ring_export / "out")
    assert m.selector is None and m.draft_ring == WINDOW  # a DFlash drafter, its cache a ring of W slots
    drafter = Drafter.from_pretrained(ring_export / "d")
    target = Target.from_pretrained(ring_export / "t", drafter.config.target_layer_ids)
    one = open_backend(ring_export / "out", "ort", "cpu")
    assert all(c.shape[1] == WINDOW for c in one.ctx)
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, target.config.vocab_size - 2, n).tolist() for n in (3, 9, 17, 30, 41)]
    news = [60, 50, 40, 48, 36]  # every request ends past the window many times over
    many = open_backend(ring_export / "out", "ort", "cpu", max_batch=3)
    assert not prefix.supported(many)  # a ring keeps its latest positions, not a prefix a parked row could reuse
    gens, _ = generate_batch(many, [Request(p, n, stop_token_ids=()) for p, n in zip(ps, news)], batch=3)
    accepted = 0
    for p, n, g in zip(ps, news, gens):
        plain = autoregressive_generate(target, p, n).tokens
        oracle = speculative_generate(target, drafter, p, n, mask_token_id=m.mask_token_id)
        alone = generate(one, p, n, stop_token_ids=())
        assert g.tokens == alone.tokens == oracle.tokens == plain
        assert g.acceptance_lengths == alone.acceptance_lengths == oracle.acceptance_lengths
        accepted += sum(a - 1 for a in g.acceptance_lengths)
    # the check has power: the drafts depend on the context the window keeps (widened, they change)
    drafter.config.layer_window = lambda j: None
    differ = sum(speculative_generate(target, drafter, p, n, mask_token_id=m.mask_token_id).acceptance_lengths
                 != g.acceptance_lengths for p, n, g in zip(ps, news, gens))
    print(f"{accepted} drafts accepted over {sum(news)} tokens, window {WINDOW}; "
          f"{differ} of {len(ps)} requests round differently without the window")
    assert accepted > 40 and differ >= 2
