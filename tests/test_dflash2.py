"""The DFlash 2 PyTorch reference (models/dflash2.py, models/generate_dflash2.py) against the
official z-lab package (`dflash` 0.1.0, `dflash.model`): tiny random drafters are built with
the official classes, saved in the released layout (codebooks without `.weight`), and loaded
into ours. Compared: drafter logits, selector paths, and greedy generation (tokens equal the
target's greedy; acceptance lengths of every full-block round equal the official loop's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runtime_cases import _bias_target, prompts

from dflash_export.models import Target, TargetConfig, autoregressive_generate, draft_config_dict
from dflash_export.models import dflash2 as D2
from dflash_export.models.dflash2 import DFlash2Config, DFlash2Drafter, dynamic_conv
from dflash_export.models.generate_dflash2 import dflash2_generate
from dflash_export.runtime.errors import DFlashError
from dflash_export.models.tiny import hf_model, make_target
from dflash_export.runtime.sampling import Sampling

torch.set_num_threads(1)
FIXTURES = Path(__file__).parent / "fixtures" / "drafter-configs"

# drafters for a 3-layer target (hidden 64, vocab 101): block sizes, softcap or not, sliding
# and full layers, causal and not (None: sliding causal, full not)
CASES = {
    "full-b4": dict(block=4, layers=["full_attention"], causal=None, kernel=2, group=16, cap=None, mult=1.0),
    "sliding-b8-softcap": dict(block=8, layers=["sliding_attention"] * 2, causal=None, window=6, kernel=2,
                               group=16, cap=20.0, mult=0.5),
    "mixed-b6-noncausal": dict(block=6, layers=["sliding_attention", "full_attention"], causal=False, window=9,
                               kernel=3, group=8, cap=5.0, mult=1.3),
    "mixed-b5-causal": dict(block=5, layers=["full_attention", "sliding_attention"], causal=True, window=40,
                            kernel=2, group=32, cap=None, mult=1.0, scale=1.5),
}


def _official():
    return pytest.importorskip("dflash.model", reason="the official z-lab package `dflash` 0.1.0 is not installed")


def dflash2_config(tc: TargetConfig, case: dict, mask: int) -> dict:
    cfg = draft_config_dict(tc, num_layers=len(case["layers"]), block_size=case["block"], target_layer_ids=[0, 2],
                            mask_token_id=mask, layer_types=case["layers"], sliding_window=case.get("window"))
    cfg["architectures"] = ["DFlash2DraftModel"]
    if case["causal"] is not None:
        cfg["is_causal"] = case["causal"]
    cfg["dflash_config"].update(block_size=case["block"], conv_kernel_size=case["kernel"], conv_group_size=case["group"],
                                selector_rank=8, selector_top_k=4, output_multiplier=case["mult"],
                                final_logit_softcapping=case["cap"], input_embedding_scale=case.get("scale", 1.0))
    return cfg


def official_drafter(directory: Path, tc: TargetConfig, case: dict, seed: int = 1):
    """A random drafter made with the official class, saved as released; -> (official model, dir)."""
    import transformers
    from safetensors.torch import save_file

    dm = _official()
    raw = dflash2_config(tc, case, mask=tc.vocab_size - 2)
    torch.manual_seed(seed)
    model = dm.DFlash2DraftModel(transformers.Qwen3Config(**raw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):  # tap 0 near identity, so the block's signal passes
                p.normal_(0.0, 0.3)
                p[:, 0] += 1.0
            elif "candidate_selector" in name:  # pair scores large enough that the walk leaves the argmax
                p.normal_(0.0, 0.4)
            elif p.dim() > 1:  # v/o sharpened: drafts depend on the context features
                p.normal_(0.0, 0.24 if ("v_proj" in name or "o_proj" in name) else 0.08)
        model.norm.weight[0] = 4.0  # leans to the biased target's favourite token: drafts get accepted
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(raw))
    state = {k.removesuffix(".weight") if "codebook" in k else k: v.contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    return model, directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = make_target(tmp_path_factory.mktemp("t") / "t", "qwen3", layers=3, seed=4, tie=False)
    _bias_target(d, 1.4)
    return d, hf_model(d), Target.from_pretrained(d, [0, 2])


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_selector_equal_the_official(pair, tmp_path, name):
    tdir, hf, target = pair
    official, ddir = official_drafter(tmp_path / "d", target.config, CASES[name])
    ours = DFlash2Drafter.from_pretrained(ddir)
    b, c, k, h = 4, 11, ours.config.block_size, target.config.hidden_size
    torch.manual_seed(0)
    taps = torch.randn(b, c, 2 * h)
    block = torch.full((b, k), ours.config.mask_token_id)
    block[:, 0] = torch.tensor([5, 7, 30, 64])  # anchors
    ctx_pos, pos = torch.arange(c)[None].expand(b, c), torch.arange(c, c + k)[None].expand(b, k)
    with torch.inference_mode():
        emb = hf.get_input_embeddings()(block) * CASES[name].get("scale", 1.0)
        want_h = official(position_ids=torch.arange(c + k)[None].expand(b, -1), noise_embedding=emb,
                          target_hidden=taps)[:, 1:]
        want = official.compute_logits(want_h, hf.lm_head)
        want_path = official.candidate_selector.select(want_h, want, block[:, 0], 0.0)[0]
        ctx = ours.context_kv(taps, ctx_pos)
        got = ours.draft_logits(target, block, pos, ctx)
        err = (got - want).abs().max().item()
        off_argmax = (want_path != want.argmax(-1)).sum().item()
        print(f"{name}: max |logits - official| = {err:.2e}; walk != argmax at {off_argmax}/{want_path.numel()}")
        assert err < 1e-4
        # the walk on the same inputs picks the same path; end to end too
        path = D2.greedy_walk(*ours.candidate_selector.pair_scores(want_h, want, block[:, 0]))[0]
        assert path.tolist() == want_path.tolist()
        assert ours.propose(target, block, pos, ctx).tolist() == want_path.tolist()
        assert off_argmax > 0, "the pair scores should change some choices, or the walk is not under test"
        if CASES[name]["cap"]:
            assert got.abs().max() <= CASES[name]["cap"]


def test_greedy_rounds_equal_the_official(pair, tmp_path, monkeypatch):
    """Tokens = the target's own greedy; every full-block round's acceptance length = the official's."""
    import time

    dm = _official()
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # its stats time with CUDA syncs; no GPU here
    tdir, hf, target = pair
    compared = accepted = argmax_differs = 0
    for name, case in CASES.items():
        official, ddir = official_drafter(tmp_path / name, target.config, case)
        ours = DFlash2Drafter.from_pretrained(ddir)
        k, mask = case["block"], ours.config.mask_token_id
        for i, prompt in enumerate(prompts(3, target.config.vocab_size, seed=10)):
            n = 24 + 7 * i
            ref = dm.dflash_generate(official, hf, torch.tensor([prompt]), n, None, return_stats=True)
            got = dflash2_generate(target, ours, prompt, n, mask_token_id=mask)
            plain = autoregressive_generate(target, prompt, n).tokens
            assert got.tokens == plain == ref.output_ids[0, len(prompt):].tolist(), (name, i)
            start = len(prompt)
            for a, b in zip(got.acceptance_lengths, ref.acceptance_lengths):
                if start + k > len(prompt) + n:  # the official loop drafts a shorter last block
                    break
                assert a == b, (name, i, got.acceptance_lengths, ref.acceptance_lengths)
                compared += 1
                accepted += a > 1
                start += a
            # the same loop with argmax drafts (no walk): the comparison above can tell them apart
            with monkeypatch.context() as mp:  # the best candidate of each position = the argmax
                mp.setattr(D2, "greedy_walk", lambda cand, scores: (cand[..., 0], None))
                plain_drafts = dflash2_generate(target, ours, prompt, n, mask_token_id=mask).acceptance_lengths
            argmax_differs += plain_drafts != ref.acceptance_lengths[: len(plain_drafts)]
    print(f"{compared} full-block rounds equal, {accepted} with accepted drafts; "
          f"argmax drafts differ from the official in {argmax_differs} runs")
    assert compared >= 30 and accepted >= 10 and argmax_differs >= 2


def test_dynamic_conv_is_causal_and_grouped():
    """Tap t reads position i - t (zero before the block); a delta moves its whole group."""
    x = torch.randn(1, 5, 8)
    base = torch.zeros(2, 8)
    base[1] = 1.0  # out[i] = x[i - 1]
    delta = torch.zeros(1, 5, 2, 2)
    out = dynamic_conv(x, base, delta, 4)
    assert torch.equal(out[:, 1:], x[:, :-1]) and torch.equal(out[:, 0], torch.zeros(1, 8))
    delta[0, 2, 0, 1] = 2.0  # position 2, tap 0, second group of 4 channels
    out = dynamic_conv(x, base, delta, 4)
    assert torch.allclose(out[0, 2, 4:], x[0, 1, 4:] + 2 * x[0, 2, 4:]) and torch.equal(out[0, 2, :4], x[0, 1, :4])


def test_released_config_parses_and_names_match():
    """The released config builds a module with every tensor name and shape of the released checkpoint."""
    raw = json.loads((FIXTURES / "dflash2-unsupported.config.json").read_text())
    c = DFlash2Config.from_dict(raw)
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 16, 256, 16)
    assert c.final_logit_softcapping == 20.0 and abs(c.output_multiplier - 0.19611613513818404) < 1e-12
    assert c.layer_types == ["sliding_attention"] * 5 and c.sliding_window == 2048 and c.is_causal is False
    assert c.target_layer_ids == [1, 13, 25, 37, 49] and c.mask_token_id == 201818
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in DFlash2Drafter(c).state_dict().items()}
    # every tensor of the released checkpoint (z-lab/dflash tests/fixtures/dflash2-safetensors-header.json)
    released = json.loads((FIXTURES.parent / "dflash2-tensor-shapes.json").read_text())
    assert shapes == released


def test_bad_dflash2_configs_are_refused():
    raw = json.loads((FIXTURES / "dflash2-unsupported.config.json").read_text())
    del raw["dflash_config"]["selector_rank"]
    with pytest.raises(DFlashError, match="lacks selector_rank"):
        DFlash2Config.from_dict(raw)
    raw = json.loads((FIXTURES / "dflash2-unsupported.config.json").read_text())
    raw["dflash_config"]["conv_group_size"] = 7
    with pytest.raises(DFlashError, match="conv_group_size must divide"):
        DFlash2Config.from_dict(raw)
    with pytest.raises(DFlashError, match="is not DFlash2DraftModel"):
        DFlash2Config.from_dict({**raw, "architectures": ["DFlashDraftModel"]})


def test_train_draft_refuses_dflash2(tmp_path):
    from click.testing import CliRunner

    from dflash_export.cli import cli

    (tmp_path / "d.txt").write_text("some text\n")
    r = CliRunner().invoke(cli, ["train-draft", "--target", str(tmp_path / "t"), "--out", str(tmp_path / "o"),
                                 "--data", str(tmp_path / "d.txt"), "--family", "dflash2"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and r.output.count("\n") == 1, r.output
    assert "training DFlash2 drafters" in r.output and "not supported" in r.output
    assert not (tmp_path / "o").exists()


def test_generator_refuses_what_it_does_not_do(pair, tmp_path):
    tdir, hf, target = pair
    _, ddir = official_drafter(tmp_path / "d", target.config, CASES["full-b4"])
    ours = DFlash2Drafter.from_pretrained(ddir)
    with pytest.raises(DFlashError, match="unknown sampling"):
        dflash2_generate(target, ours, [1, 2], 5, mask_token_id=99, sampling=Sampling(0.8, method="typical"))
    with pytest.raises(DFlashError, match="block size must be >= 2"):
        dflash2_generate(target, ours, [1, 2], 5, mask_token_id=99, block_size=1)
    with pytest.raises(DFlashError, match="not supported for DFlash2"):
        ours.set_draft_vocab(torch.arange(10), target.lm_head.weight)
    # a stop token ends the generation where the target's greedy output has it
    plain = autoregressive_generate(target, [3, 4, 5], 20).tokens
    got = dflash2_generate(target, ours, [3, 4, 5], 20, mask_token_id=99, stop_token_ids=(plain[6],))
    assert got.stopped and got.tokens == plain[: plain.index(plain[6]) + 1]


def test_sampled_walk_q_equals_the_official(pair, tmp_path, monkeypatch):
    """At T = 0.8 the official selector, made to take our sampled path, gives our q rows
    (compared spread over the candidate ids: the two order their top-k differently)."""
    dm = _official()
    tdir, hf, target = pair
    official, ddir = official_drafter(tmp_path / "d", target.config, CASES["sliding-b8-softcap"])
    ours = DFlash2Drafter.from_pretrained(ddir)
    sel, v = ours.candidate_selector, target.config.vocab_size
    torch.manual_seed(3)
    b, n = 4, 7
    hidden, logits, anchor = torch.randn(b, n, target.config.hidden_size), 4 * torch.randn(b, n, v), torch.arange(b)
    u = torch.rand(b, n)
    with torch.inference_mode():
        path, cand, q = sel.sample_walk(hidden, logits, anchor, 0.8, u)
        # the official draws an index over its own candidates (topk, unsorted): make it ours, found by id
        official_cand = torch.topk(logits, sel.top_k, dim=-1, sorted=False)[1]
        step = iter(range(n))
        monkeypatch.setattr(dm, "_sample_probs", lambda probs: (official_cand[:, (i := next(step))] == path[:, i, None]).int().argmax(-1))
        want_path, want_cand, want_q = official.candidate_selector.select(hidden, logits, anchor, 0.8)
    assert torch.equal(want_path, path)
    ours_v = torch.zeros(b, n, v).scatter(-1, cand, q)
    want_v = torch.zeros(b, n, v).scatter(-1, want_cand, want_q.float())
    err = (ours_v - want_v).abs().max().item()
    print(f"max |q - official q| = {err:.2e}")
    assert err < 1e-5
    assert ((q > 0.01).sum(-1) > 1).any(), "q should spread over several candidates at T = 0.8"
    # the draws follow q: uniforms on a grid of 1000 pick each first-position candidate q * 1000 times (+-1)
    m = 1000
    grid = ((torch.arange(m) + 0.5) / m)[:, None].expand(m, n)
    with torch.inference_mode():
        p_m, c_m, q_m = sel.sample_walk(hidden[:1].expand(m, -1, -1), logits[:1].expand(m, -1, -1), anchor[:1].expand(m), 0.8, grid)
    counts = (c_m[0, 0][:, None] == p_m[:, 0][None]).sum(-1).float()
    assert (counts - q_m[0, 0] * m).abs().max() <= 1.0, (counts, q_m[0, 0] * m)
