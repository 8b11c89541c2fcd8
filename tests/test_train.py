"""Drafter training: the loss weights, the context mask, the training forward vs inference,
learning on a tiny target, the saved drafter, resume, and the CLI's one-line errors."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch.nn import functional as F
from click.testing import CliRunner
from killed import kill_after
from train_fixtures import SAMPLE, make_tokenized_target

from dflash_export.cli import cli
from dflash_export.models import Drafter, Target, TargetConfig, autoregressive_generate, new_drafter
from dflash_export.train import train as T
from dflash_export.train import data as D

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tokenized_target(root / "target")
    (root / "data.txt").write_text(SAMPLE * 12)
    return root, target


def test_loss_weights_follow_formula():
    w = T.loss_weights(16, 7.0)
    assert w.shape == (15,)
    for k in range(1, 16):
        assert w[k - 1].item() == pytest.approx(math.exp(-(k - 1) / 7.0), rel=1e-6)
    assert w[0] == 1.0 and torch.all(w[1:] < w[:-1])


def test_context_mask_excludes_anchor_and_after(tiny):
    _, target_dir = tiny
    drafter = new_drafter(TargetConfig.load(target_dir), num_layers=1, block_size=4, mask_token_id=1)
    anchors = torch.tensor([0, 3, 7])
    vis = drafter.block_mask(0, 10, 4, anchors)[:, 0]
    assert vis.shape == (3, 14)
    for i, a in enumerate(anchors.tolist()):
        ctx = vis[i, :10]
        assert ctx[:a].all(), "every position before the anchor is visible"
        assert not ctx[a:].any(), "the anchor's own position and everything after it are hidden"
        assert vis[i, 10:].all(), "the block sees all of itself (non-causal)"


@pytest.mark.parametrize("layer_types,window", [(None, None), (["full_attention", "sliding_attention"], 3),
                                                 (["sliding_attention", "sliding_attention"], 6)])
def test_training_forward_equals_inference(tiny, layer_types, window):
    """A block in the batched training forward gives the logits the inference path gives
    with a context cache of exactly the positions before its anchor, block for block, for
    full and sliding-window (causal, windowed) layers alike."""
    _, target_dir = tiny
    torch.manual_seed(0)
    tc = TargetConfig.load(target_dir)
    target = Target.from_pretrained(target_dir, tap_ids=[1, 3])
    drafter = new_drafter(tc, num_layers=2, block_size=4, target_layer_ids=[1, 3], mask_token_id=1,
                          layer_types=layer_types, sliding_window=window)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    tokens = torch.randint(3, 100, (2, 20))
    # blocks in any order (per-block gathered context), and sequence-major with equal counts
    # (train.forward.grouped_block, the path training takes): both must equal inference
    layouts = [(torch.tensor([5, 11, 9, 0, 16]), torch.tensor([0, 0, 1, 1, 0])),
               (torch.tensor([16, 2, 9, 0, 7, 12]), torch.tensor([0, 0, 0, 1, 1, 1]))]
    with torch.no_grad():
        pos = torch.arange(20)[None].expand(2, 20)
        _, taps, _ = target(tokens, pos, target.empty_kv(2))
        ctx = drafter.context_kv(taps, pos)
        for anchors, seq_index in layouts[::-1]:
            block, _, _ = T.block_batch(tokens, torch.tensor([20, 20]), seq_index, anchors, 4, 1)
            got = T.block_logits(drafter, target, ctx, seq_index, block, anchors)
            for i, (b, a) in enumerate(zip(seq_index.tolist(), anchors.tolist())):
                cache = drafter.context_kv(taps[b : b + 1, :a], pos[:1, :a])  # positions < a only
                want = drafter.draft_logits(target, block[i : i + 1], torch.arange(a, a + 4)[None], cache)
                torch.testing.assert_close(got[i : i + 1], want, atol=1e-5, rtol=1e-5)
            if window:  # the sliding layer's own mask matters too: the full-attention drafter differs
                full = new_drafter(tc, num_layers=2, block_size=4, target_layer_ids=[1, 3], mask_token_id=1)
                full.load_state_dict(drafter.state_dict())
                assert (T.block_logits(full, target, ctx, seq_index, block, anchors) - got).abs().max() > 1e-4
        # and the anchor's own features would change the result: the mask matters
        leak = drafter.context_kv(taps[:1, :6], pos[:1, :6])
        leaked = drafter.draft_logits(target, block[:1], torch.arange(5, 9)[None], leak)
        assert (leaked - got[:1]).abs().max() > 1e-4


def test_continue_batch_labels_are_plain_greedy_decoding(tiny):
    """The training labels: each row of the batched generator (batched steps over an
    in-place KV cache, last-position logits only) equals the target's plain autoregressive greedy decoding of that row,
    token for token, also after a sampled prefix."""
    _, target_dir = tiny
    target = Target.from_pretrained(target_dir)
    prompts = torch.randint(3, 100, (3, 7), generator=torch.Generator().manual_seed(0))
    for sample_prefix in (0, 4):
        s = D.continue_batch(target, prompts, 14, sample_prefix, generator=torch.Generator().manual_seed(1))
        assert s.tokens.shape == (3, 21) and s.start == 7 + sample_prefix
        assert torch.equal(s.tokens[:, :7], prompts)
        for row in s.tokens.tolist():
            assert row[s.start :] == autoregressive_generate(target, row[: s.start], 21 - s.start).tokens
        full = Target.from_pretrained(target_dir, tap_ids=[1, 3])
        with torch.no_grad():  # the features captured while generating = one forward over the whole sequence
            want = full(s.tokens, torch.arange(21)[None].expand(3, 21), full.empty_kv(3))[1]
        got = D.continue_batch(full, prompts, 14, sample_prefix, generator=torch.Generator().manual_seed(1))
        assert torch.equal(got.tokens, s.tokens) and got.taps.dtype == torch.bfloat16
        torch.testing.assert_close(got.taps.float(), want, atol=2e-2, rtol=1e-2)
        if sample_prefix:  # the sampled prefix is not greedy everywhere (else this case tests nothing new)
            greedy = D.continue_batch(target, prompts, 14).tokens
            assert not torch.equal(greedy[:, 7 : s.start], s.tokens[:, 7 : s.start])


def test_generation_time_limit_cuts_the_batch_and_caches_nothing(tiny, tmp_path):
    """A batch under way when generation's time limit passes is cut short (at least 16 new tokens)
    and used, but neither it nor its features are cached: a later run must not take it as whole."""
    _, target_dir = tiny
    target = Target.from_pretrained(target_dir, tap_ids=[1])
    batches = [torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    seen = []
    shards, names, _ = D.generate_shards(target, batches, tmp_path / "g", 40, 0, (), 0, seconds=1e-9,
                                         on_features=lambda n, t, c: seen.append((n, t.shape[1], c)))
    assert len(shards) == 1 and shards[0].tokens.shape == (2, 5 + 16) and names[0].endswith("-partial")
    assert seen == [(names[0], 21, False)] and not list((tmp_path / "g").glob("*.pt"))


def test_fused_head_loss_equals_cross_entropy():
    """train/loss.py: the chunked head + loss with its gradient computed in the forward pass
    gives plain weighted cross-entropy's loss and input gradient (fp32 and bf16 autocast)."""
    from dflash_export.train.loss import head_loss

    g = torch.Generator().manual_seed(0)
    for bf16 in (False, True):
        h = torch.randn(300, 32, generator=g, requires_grad=True)
        head, labels, w = torch.randn(50, 32, generator=g), torch.randint(0, 50, (300,), generator=g), torch.rand(300, generator=g)
        w[::7] = 0  # skipped rows (outside the sequence)
        loss = head_loss(h, head, labels, w, bf16=bf16, chunk=64)
        loss.backward()
        got, h.grad = h.grad, None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            z = F.linear(h, head).float()
        want = (F.cross_entropy(z, labels, reduction="none") * w).sum()
        want.backward()
        torch.testing.assert_close(loss, want, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(got, h.grad, atol=1e-5, rtol=1e-4)


def test_training_reduces_weighted_loss(tiny):
    _, target_dir = tiny
    torch.manual_seed(0)
    tc = TargetConfig.load(target_dir)
    target = Target.from_pretrained(target_dir, tap_ids=[1, 2]).requires_grad_(False)
    drafter = new_drafter(tc, num_layers=1, block_size=4, target_layer_ids=[1, 2], mask_token_id=1)
    prompts = torch.randint(3, 100, (8, 6))
    shard = D.continue_batch(target, prompts, 24)
    assert shard.tokens.shape == (8, 30) and shard.start == 6
    w = T.loss_weights(4, 4.0)
    gen = torch.Generator().manual_seed(0)
    rows = torch.arange(8)
    fixed = T.sample_anchors(shard, rows, 16, torch.Generator().manual_seed(1))

    def held_loss():
        with torch.no_grad():
            return T.draft_step(target, drafter, shard.tokens, shard.length, *fixed, 4, 1, w)[0].item()

    before = held_loss()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(40):
        si, an = T.sample_anchors(shard, rows, 16, gen)
        assert (an >= shard.start - 1).all() and (an <= 28).all()
        loss, _, _ = T.draft_step(target, drafter, shard.tokens, shard.length, si, an, 4, 1, w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = held_loss()
    assert after < 0.8 * before, (before, after)


def test_cli_training_reduces_weighted_loss(tiny):
    """The same claim through `train-draft --steps N` (its schedule, precision and cached features):
    the held-out weighted loss falls. --data takes several files after one flag."""
    root, target = tiny
    (root / "a.txt").write_text(SAMPLE * 6)
    (root / "b.txt").write_text(SAMPLE * 6)
    args = ["train-draft", "--target", str(target), "--out", str(root / "cli-loss"), "--data", str(root / "a.txt"),
            str(root / "b.txt"), "--block-size", "4", "--target-layer-ids", "1,2", "--sequences", "64", "--gen-tokens",
            "24", "--gen-batch", "8", "--train-batch", "8", "--anchors", "16", "--lr", "3e-3", "--steps", "40",
            "--eval-tokens", "8", "--torch-threads", "1"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "precision (training): " in r.output and "total wall" in r.output
    log = json.loads((root / "cli-loss" / "training.json").read_text())
    before, after = log["initial"]["tf_loss"], log["final"]["tf_loss"]
    assert log["train_steps"] == 40 and after < 0.8 * before, (before, after)
    # every sequence's features were captured while generating: the target never ran in a step
    f = log["features"]
    assert f["captured_rows"] == log["sequences"] and f["computed_rows"] == 0 and f["reused_rows"] > 0, f


def test_cli_max_total_minutes_bounds_the_run(tiny):
    """--max-total-minutes: a step count that cannot fit is cut, evaluation still runs, the wall is reported."""
    root, target = tiny
    r = _train(root, target, root / "bounded", "--steps", "100000", "--max-total-minutes", "0.2")
    assert r.exit_code == 0, r.output
    assert "stopped at step" in r.output and "total wall" in r.output
    log = json.loads((root / "bounded" / "training.json").read_text())
    assert 0 < log["train_steps"] < 100000, log
    assert log["wall_seconds"] < 0.2 * 60 + 6, log["wall_seconds"]  # + slack for a loaded machine
    assert log["final"]["real_tau"] >= 1.0


def test_schedule_follows_the_budget():
    """Warmup and decay scale with the budget: 2 minutes and 2 hours both reach the peak and end at 10%."""
    from dflash_export.train.state import Schedule

    for seconds in (120.0, 7200.0):
        s = Schedule(1e-3, warmup=0.05, seconds=seconds)
        assert s(0, 0.0) < 1e-4
        assert s(50, 0.05 * seconds) == pytest.approx(1e-3, rel=0.01)
        assert s(999, seconds) == pytest.approx(1e-4)
    s = Schedule(1e-3, warmup=0.05, steps=100)
    assert s(4, 0.0) == pytest.approx(1e-3, rel=0.01) and s(99, 0.0) == pytest.approx(1e-4)


def test_precision_is_measured_once_and_cached(tmp_path, monkeypatch):
    from dflash_export.train import speed as P

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def probe(bf16):  # bf16 made 10x slower on purpose: auto must pick fp32
        calls.append(bf16)
        time.sleep(0.02 if bf16 else 0.002)
    lines = []
    assert P.choose("training", "auto", "test shape", probe, lines.append) == "fp32"
    n = len(calls)
    assert n >= 2 and "measured now" in lines[-1]
    assert P.choose("training", "auto", "test shape", probe, lines.append) == "fp32"
    assert len(calls) == n and "cached" in lines[-1]  # no second measurement
    assert P.choose("training", "bf16", "test shape", probe, lines.append) == "bf16"


def _train(root, target, out, *extra):
    args = ["train-draft", "--target", str(target), "--out", str(out), "--data", str(root / "data.txt"),
            "--block-size", "4", "--layers", "1", "--target-layer-ids", "1,2", "--sequences", "32",
            "--gen-tokens", "16", "--gen-batch", "8", "--train-batch", "4", "--anchors", "8", "--eval-tokens", "12",
            "--torch-threads", "1", *extra]
    return CliRunner().invoke(cli, args)


def test_cli_saves_zlab_drafter_and_resumes(tiny):
    root, target = tiny
    out = root / "draft"
    r = _train(root, target, out, "--steps", "6")
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": 1}
    from safetensors.torch import load_file

    names = set(load_file(out / "model.safetensors"))
    assert "fc.weight" in names and "layers.0.self_attn.q_norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    d = Drafter.from_pretrained(out)  # round trip: save -> load -> save gives the same tensors
    d.save_pretrained(root / "again")
    a, b = load_file(out / "model.safetensors"), load_file(root / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = json.loads((out / "training.json").read_text())
    assert log["train_steps"] == 6 and log["final"]["real_tau"] >= 1.0
    assert len(log["final"]["tf_acc"]) == 3

    ck = torch.load(root / "draft.work" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 6
    # resumed with other evaluation prompts: the training continuations and features are reused
    (root / "held.jsonl").write_text(json.dumps({"prompt": SAMPLE[:40]}) + "\n")
    r = _train(root, target, out, "--steps", "9", "--resume", "--eval-prompts", str(root / "held.jsonl"))
    assert r.exit_code == 0, r.output
    assert "resumed at step 6" in r.output
    assert "continuations x 16 tokens (0 of " in r.output, r.output
    assert json.loads((out / "training.json").read_text())["train_steps"] == 9
    ck2 = torch.load(root / "draft.work" / "checkpoint.pt", weights_only=False)
    assert ck2["step"] == 9 and not torch.equal(ck["drafter"]["fc.weight"], ck2["drafter"]["fc.weight"])


def test_a_killed_train_draft_is_cleaned_by_the_next_run(tiny):
    """train-draft killed with -9 while writing OUT (its drafter in the staging folder beside OUT, no
    cleanup runs) leaves OUT as it was; the next run on the same OUT removes the folder and publishes."""
    root, target = tiny
    out = root / "killed"
    args = ["train-draft", "--target", str(target), "--out", str(out), "--data", str(root / "data.txt"),
            "--block-size", "4", "--layers", "1", "--target-layer-ids", "1,2", "--sequences", "16", "--gen-tokens", "8",
            "--gen-batch", "8", "--train-batch", "4", "--anchors", "8", "--eval-tokens", "4", "--torch-threads", "1", "--steps", "1"]
    pid = kill_after("dflash_export.models.drafter", "Drafter.save_pretrained", args)
    left = list(root.glob(".killed.*"))
    assert [p.name for p in left] == [f".killed.partial-{pid}"] and (left[0] / "model.safetensors").is_file()
    assert not out.exists()
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert not list(root.glob(".killed.*")) and (out / "model.safetensors").is_file() and (out / "training.json").is_file()


def test_cli_init_starts_from_a_drafters_weights(tiny):
    """--init DRAFT: a warm restart from a finished drafter (its weights, a fresh optimizer); at lr 0
    the written drafter is the one it started from. A drafter of another shape is refused in one line."""
    from safetensors.torch import load_file

    root, target = tiny
    r = _train(root, target, root / "first", "--steps", "3")
    assert r.exit_code == 0, r.output
    r = _train(root, target, root / "warm", "--steps", "2", "--lr", "0", "--init", str(root / "first"))
    assert r.exit_code == 0, r.output
    assert f"initialised from {root / 'first'}" in r.output
    a, b = load_file(root / "first" / "model.safetensors"), load_file(root / "warm" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    r = _train(root, target, root / "wrong", "--steps", "1", "--target-layer-ids", "1", "--init", str(root / "first"))
    assert r.exit_code == 2 and r.output.startswith("error: --init") and r.output.count("\n") == 1, r.output
    r = _train(root, target, root / "both", "--steps", "1", "--resume", "--init", str(root / "first"))
    assert r.exit_code == 2 and "not both" in r.output, r.output


def test_bf16_save_loads_as_fp32(tiny):
    root, target = tiny
    out = root / "draft16"
    r = _train(root, target, out, "--steps", "2", "--save-dtype", "bf16")
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    assert load_file(out / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    assert Drafter.from_pretrained(out).fc.weight.dtype == torch.float32


@pytest.mark.parametrize("extra, message", [
    (["--target-layer-ids", "1,9"], "outside the target's 4 layers"),
    (["--mask-token-id", "500"], "outside the target's vocabulary"),
    ([], "--steps 0 and --minutes 0 train for nothing: give --steps N"),
    (["--steps", "0"], "--steps 0 and --minutes 0 train for nothing: give --steps N"),
    (["--minutes", "2"], "give --steps N or --minutes M, not both"),
    (["--steps", "-3"], "--steps must be > 0 (got -3)"),
    (["--target-layer-ids", "1-x"], "is not a list like"),
    (["--family", "dflash2"], "DFlash drafters only"),
])
def test_cli_one_line_errors(tiny, extra, message):
    root, target = tiny
    steps = [] if not extra else ["--steps", "1"]  # a later --steps in extra wins
    r = _train(root, target, root / "bad", *steps, *extra)
    assert r.exit_code == 2
    assert message in r.output and r.output.startswith("error: ") and r.output.count("\n") == 1
    assert not (root / "bad").exists()


def test_cli_refuses_target_without_tokenizer(tmp_path):
    from dflash_export.models.tiny import make_target

    t = make_target(tmp_path / "t")
    (tmp_path / "d.txt").write_text(SAMPLE)
    r = CliRunner().invoke(cli, ["train-draft", "--target", str(t), "--out", str(tmp_path / "o"),
                                 "--data", str(tmp_path / "d.txt"), "--steps", "1"])
    assert r.exit_code == 2 and "no tokenizer.json" in r.output
