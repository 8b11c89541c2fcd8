"""Lossless, on 4 exported pairs x 13 prompts: the ORT runtime at temperature 0 equals the
PyTorch oracle token for token and round for round, and transformers' greedy generate.

Pairs (runtime_cases.CASES): Qwen3 3-layer + 2-layer drafter, block 8 (biased target:
mostly long acceptances); Llama tied + llama3 RoPE, 1-layer drafter, block 4; Qwen2 (qkv
bias) + 3-layer drafter, block 16 (biased: mixed acceptances); Qwen3 + 1-layer drafter,
block 16 (random: rejections). The first run exports them (~30-60 s each), later runs
reuse the content-keyed cache.
"""

from __future__ import annotations

import pytest
import torch
from runtime_cases import CASES, artifact, prompts
from dflash_export.models.tiny import hf_model

from dflash_export.models import Drafter, Target, speculative_generate
from dflash_export.models.draft_config import DraftConfig
from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort.backend import OrtBackend

PROMPTS_PER_PAIR = 13


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_oracle_and_transformers(name):
    tdir, ddir, out = artifact(CASES[name])
    dc = DraftConfig.load(ddir)
    target, drafter = Target.from_pretrained(tdir, dc.target_layer_ids), Drafter.from_pretrained(ddir)
    hf = hf_model(tdir)
    be = OrtBackend(out)
    m = be.manifest
    eos = tuple(m.eos_token_ids)
    cases = accepted = 0
    for i, prompt in enumerate(prompts(PROMPTS_PER_PAIR, m.vocab_size, seed=100 + len(name))):
        n = 24 + 5 * i
        g = generate(be, prompt, n)
        o = speculative_generate(target, drafter, prompt, n, mask_token_id=m.mask_token_id, block_size=m.block_size,
                                 stop_token_ids=eos, max_context=m.max_context)
        assert g.tokens == o.tokens, (name, i)
        assert g.acceptance_lengths == o.acceptance_lengths, (name, i)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=n, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])
        assert g.tokens == ref[0, len(prompt):].tolist(), (name, i)
        assert g.tokens == generate(be, prompt, n, draft=False).tokens
        accepted += sum(a > 1 for a in g.acceptance_lengths)
        cases += 1
    assert cases == PROMPTS_PER_PAIR
    if CASES[name].bias:  # the comparison is meaningful: biased pairs accept drafts (> 1 token) in many rounds
        assert accepted > PROMPTS_PER_PAIR, (name, accepted)

