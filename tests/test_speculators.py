"""Speculators-format DFlash drafters (vllm-project/speculators, RedHatAI's releases) read as
the z-lab drafter they are: the same config, the same drafts, a reduced draft vocabulary from
their d2t map; and refused in one line where they are not a DFlash drafter for this target.
The exported half (graphs, runtime, check) is in test_sources.py."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import numpy as np
import pytest
import torch
from runtime_cases import FIXTURES, _bias_target, prompts
from safetensors.torch import load_file, save_file
from speculators_format import to_speculators

from dflash_export.runtime.errors import DFlashError
from dflash_export.models import Target, speculative_generate
from dflash_export.models.draft_config import DraftConfig
from dflash_export.models.dflash2 import load_draft_config, load_drafter
from dflash_export.models.tiny import make_drafter, make_target


def test_released_config_reads_as_its_zlab_original(tmp_path):
    """Qwen3-8B-DFlash-b16's config, converted with the keys equal to Qwen3Config's defaults left
    out (hidden 4096, head_dim 128, ...: as speculators' to_diff_dict may write them), parses to
    the same drafter: dims, taps (aux ids - 1), block size, mask token, windows."""
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    cfg = json.loads((FIXTURES / "qwen3-8b-dflash-b16.config.json").read_text())
    cfg["dflash_config"] = {"mask_token_id": 151669}
    (zlab / "config.json").write_text(json.dumps(cfg))
    spec = to_speculators(zlab, None, tmp_path / "spec", config_only=True)
    layer = json.loads((spec / "config.json").read_text())["transformer_layer_config"]
    assert "hidden_size" not in layer and "head_dim" not in layer  # the defaults are really exercised
    mine, theirs = load_draft_config(spec), load_draft_config(zlab)
    assert mine.format == "speculators" and mine.verifier == "acme/tiny" and mine.draft_vocab_size is None
    skip = ("raw", "format", "verifier", "num_target_layers")  # speculators does not write num_target_layers
    assert {k: v for k, v in asdict(mine).items() if k not in skip} == {k: v for k, v in asdict(theirs).items() if k not in skip}
    assert mine.target_layer_ids == [1, 9, 17, 25, 33]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Two tiny pairs (Qwen3 with a sliding drafter layer; Llama, tied, 2 drafter layers), each
    drafter in z-lab format and converted: full vocabulary and a reduced one (about 30 of 97 ids)."""
    root = tmp_path_factory.mktemp("spec")
    out = []
    for arch, seed, extra in (("qwen3", 0, dict(layers=2, layer_types=["full_attention", "sliding_attention"],
                                                 sliding_window=3)),
                              ("llama", 1, dict(layers=2))):
        d = root / arch
        make_target(d / "t", arch, seed=seed, layers=3, vocab=97, tie=arch == "llama")
        _bias_target(d / "t", 2.0)  # real acceptance: the target favours token 7
        make_drafter(d / "z", d / "t", block_size=5, seed=seed, mask_token_id=95, target_layer_ids=[0, 1], **extra)
        rng = np.random.default_rng(seed)
        ids = np.unique(np.concatenate([[7, 96], rng.choice(97, 28, replace=False)]))
        to_speculators(d / "z", d / "t", d / "full")
        to_speculators(d / "z", d / "t", d / "reduced", ids=ids)
        out.append((d, ids))
    return out


def test_same_drafts_as_the_zlab_drafter(pairs):
    """Block outputs (ids, logits, confidence) equal bit for bit, and speculative decoding gives the
    same tokens and acceptance lengths, for the full and the reduced draft vocabulary."""
    for d, ids in pairs:
        target = Target.from_pretrained(d / "t", [0, 1])
        zlab = load_drafter(d / "z")
        for kind in ("full", "reduced"):
            spec = load_drafter(d / kind)
            spec.attach(target, kind)
            if kind == "reduced":
                zlab.set_draft_vocab(torch.from_numpy(ids), target.lm_head.weight)
                assert spec.vocab_ids.tolist() == ids.tolist()
            else:
                assert spec.vocab_ids is None
            with torch.inference_mode():
                _, taps, _ = target(torch.tensor([[1, 2, 3, 7]]), torch.arange(4)[None], target.empty_kv())
                block = torch.tensor([[7] + [95] * 4])
                a = zlab.block_outputs(target, block, torch.arange(4, 9)[None], zlab.context_kv(taps, torch.arange(4)[None]))
                b = spec.block_outputs(target, block, torch.arange(4, 9)[None], spec.context_kv(taps, torch.arange(4)[None]))
            assert all(torch.equal(x, y) for x, y in zip(a, b))
            accepted = 0
            for p in prompts(3, 95, seed=1):
                x = speculative_generate(target, zlab, p, 16, mask_token_id=95, stop_token_ids=())
                y = speculative_generate(target, spec, p, 16, mask_token_id=95, stop_token_ids=())
                assert (x.tokens, x.acceptance_lengths) == (y.tokens, y.acceptance_lengths)
                accepted += sum(a - 1 for a in y.acceptance_lengths)
            assert accepted > 0, "the biased target's favourite token is drafted: some drafts are accepted"


def _edit(src, dst, config=None, state=None):
    """A copy of a speculators drafter with its config / tensors edited."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (config or (lambda c: None))(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    (state or (lambda s: None))(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("config,state,match", [
    (lambda c: c.update(speculators_model_type="eagle3"), None, "is a speculators 'eagle3' speculator, not a DFlash drafter"),
    (lambda c: c.update(sample_from_anchor=True), None, "sample_from_anchor=true"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[0, 1]), None, "include 0 (the embedding output)"),
    (lambda c: c["transformer_layer_config"].update(model_type="llama"), None, "model_type 'llama' is not supported"),
    (lambda c: c.pop("mask_token_id"), None, "lacks 'mask_token_id'"),
    (None, lambda s: s.pop("d2t"), "needs d2t"),
    (None, lambda s: s["d2t"].__setitem__(0, -1), "d2t maps draft ids outside [0, 97)"),
    (None, lambda s: s["t2d"].logical_not_(), "t2d and d2t disagree"),
    (None, lambda s: s.__setitem__("lm_head.weight", s["lm_head.weight"][:-1]), "lm_head.weight has shape"),
    (None, lambda s: s.__setitem__("layers.0.self_attn.qkv_proj.weight", s["fc.weight"].clone()), "unsupported tensors"),
])
def test_bad_speculators_drafters_are_refused(pairs, tmp_path, config, state, match):
    d, _ = pairs[0]
    bad = _edit(d / "reduced", tmp_path / "bad", config, state)
    with pytest.raises(DFlashError, match=re.escape(match)) as e:
        load_drafter(bad)
    assert "\n" not in str(e.value)


def test_a_drafter_for_another_target_is_refused(pairs):
    """The embedding it copied is not this target's: it was made for another one (named)."""
    (d, _), (other, _) = pairs
    target = Target.from_pretrained(other / "t", [0, 1])
    spec = load_drafter(d / "full")
    with pytest.raises(DFlashError, match=r"embed_tokens.weight is not the target's copy: this drafter was made for "
                                          r"another target \(made for acme/tiny\)"):
        spec.attach(target, "drafter x")


def test_a_target_or_a_drafter_in_the_wrong_place_says_what_it_is(pairs):
    d, ids = pairs[0]
    with pytest.raises(DFlashError, match=r"is a language model \(a target\?\), not a DFlash drafter"):
        load_draft_config(d / "t")
    with pytest.raises(DFlashError, match=r"is a DFlash drafter \(DFlashSpeculator\), not a target: pass it as --draft"):
        Target.from_pretrained(d / "reduced")
    cfg = DraftConfig.load(d / "reduced")  # the plain z-lab loader reads the format too
    assert cfg.format == "speculators" and cfg.draft_vocab_size == len(ids) < 97
