"""Acceptance lengths against a reference written from the official z-lab algorithm
(tests/zlab_reference.py: transformers' target and `output_hidden_states`, the official
full-block loop), round for round, except a last round cut to the token budget (see
`assert_rounds_match`).

- the PyTorch oracle (`models.speculative_generate`) on Llama, Qwen2 and Qwen3 targets with
  drafters that tap the target's last layer, that do not, and that have a sliding layer;
- `dflash-export generate --json` (the runtime loop over ONNX Runtime) on the exported pairs
  of tests/runtime_cases.py (three of the four tap the target's last layer).

Targets are biased (runtime_cases) so that random drafters get real acceptance: the
comparison covers accepted drafts and bonus tokens, not only rejections.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from runtime_cases import CASES, _bias_target, artifact, prompts
from dflash_export.models.tiny import ARCHS, hf_model, make_drafter, make_target
from zlab_reference import RefDrafter, assert_rounds_match, zlab_generate

from dflash_export.cli import cli
from dflash_export.models import Drafter, Target, speculative_generate

torch.set_num_threads(1)

SHAPES = {  # drafters for a 3-layer target
    "taps-last": dict(layers=2, block_size=8, target_layer_ids=[0, 2]),
    "taps-inner": dict(layers=1, block_size=4, target_layer_ids=[1]),
    "sliding-taps-last": dict(layers=2, block_size=8, target_layer_ids=[1, 2], sliding_window=3,
                              layer_types=["sliding_attention", "full_attention"]),
}


# target bias and drafter sharpening per architecture, chosen (by a scan) for acceptance > 1 in many rounds
BIAS = {"llama": 1.4, "qwen2": 2.2, "qwen3": 1.4}
SHARP = {"llama": 3.0, "qwen2": 1.0, "qwen3": 3.0}


@pytest.fixture(scope="module", params=ARCHS)
def biased(request, tmp_path_factory):
    arch = request.param
    d = make_target(tmp_path_factory.mktemp(arch) / "t", arch, layers=3, seed=4, tie=False)
    _bias_target(d, BIAS[arch])
    return d, hf_model(d), SHARP[arch]


def sharp_drafter(directory, target_dir, sharp: float = 3.0, **kwargs):
    """A random z-lab drafter whose attention output (v_proj, o_proj x `sharp`) outweighs the
    block embedding, so its drafts depend on the context features, the thing under test."""
    from safetensors.torch import load_file, save_file

    d = make_drafter(directory, target_dir, seed=1, **kwargs)
    w = load_file(str(d / "model.safetensors"))
    w = {k: v * sharp if ("v_proj" in k or "o_proj" in k) else v for k, v in w.items()}
    save_file(w, str(d / "model.safetensors"))
    return d


def test_oracle_rounds_equal_the_official_algorithm(biased, tmp_path):
    """Every drafter shape on this architecture's target, two budgets per prompt."""
    tdir, hf, sharp = biased
    accepted = extra_rounds = 0
    for shape, kwargs in SHAPES.items():
        ddir = sharp_drafter(tmp_path / shape, tdir, sharp, **kwargs)
        ref, drafter = RefDrafter(ddir), Drafter.from_pretrained(ddir)
        target = Target.from_pretrained(tdir, drafter.config.target_layer_ids)
        for i, prompt in enumerate(prompts(3, target.config.vocab_size, seed=10)):
            budget = 24 + 9 * i
            tokens, official = zlab_generate(hf, ref, prompt, budget)
            # a second budget that ends exactly on a round boundary: the official loop runs one more round
            for n, want in ((budget, tokens), (1 + sum(official[:2]), None)):
                if want is None:
                    want, official = zlab_generate(hf, ref, prompt, n)
                o = speculative_generate(target, drafter, prompt, n, mask_token_id=ref.mask_token_id)
                assert o.tokens == want, (shape, i, n)
                assert_rounds_match(o.acceptance_lengths, official, n)
                accepted += sum(a > 1 for a in o.acceptance_lengths)
                extra_rounds += len(official) - len(o.acceptance_lengths)
    print(f"{accepted} rounds accepted drafts")
    assert accepted >= 5, "the biased target should accept drafts in several rounds"
    assert extra_rounds >= 3 * len(SHAPES)  # the exact-budget case was exercised for every prompt


@pytest.mark.parametrize("name", list(CASES))
def test_generate_json_rounds_equal_the_official_algorithm(name):
    tdir, ddir, out = artifact(CASES[name])
    hf, ref = hf_model(tdir), RefDrafter(ddir)
    for i, prompt in enumerate(prompts(3, hf.config.vocab_size, seed=20)):
        n = 30 + 11 * i
        tokens, official = zlab_generate(hf, ref, prompt, n)
        r = CliRunner().invoke(cli, ["generate", str(out), "--prompt-ids", ",".join(map(str, prompt)),
                                     "--max-new-tokens", str(n), "--stop-ids", "", "--json", "--threads", "1"])
        assert r.exit_code == 0, r.output
        g = json.loads(r.stdout)
        assert g["tokens"] == tokens, (name, i)
        assert_rounds_match(g["acceptance_lengths"], official, n)


def test_the_comparison_tells_normed_from_raw_last_taps(tmp_path):
    """The reference with the last tap taken before the final norm (the old mistake) gives
    other acceptance lengths than the oracle: the comparison above can fail."""
    tdir = make_target(tmp_path / "t", "qwen3", layers=3, seed=4, tie=False)
    _bias_target(tdir, BIAS["qwen3"])
    ddir = sharp_drafter(tmp_path / "d", tdir, **SHAPES["taps-last"])
    hf, ref, drafter = hf_model(tdir), RefDrafter(ddir), Drafter.from_pretrained(ddir)
    target = Target.from_pretrained(tdir, drafter.config.target_layer_ids)
    differ = 0
    for prompt in prompts(4, target.config.vocab_size, seed=10):
        o = speculative_generate(target, drafter, prompt, 40, mask_token_id=ref.mask_token_id)
        assert_rounds_match(o.acceptance_lengths, zlab_generate(hf, ref, prompt, 40)[1], 40)
        differ += zlab_generate(hf, ref, prompt, 40, raw_last=True)[1][: len(o.acceptance_lengths)] != o.acceptance_lengths
    assert differ >= 2, differ
