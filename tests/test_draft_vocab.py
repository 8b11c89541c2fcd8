"""A reduced draft vocabulary (`export --draft-vocab N`): chosen from data, recorded, lossless.

The oracle half runs many random tiny pairs in PyTorch (fast): speculative output with
a drafter scoring N tokens == plain greedy. The export half exports one biased pair (real
acceptance) through the CLI with N tokens chosen from data and checks the graph against the
oracle round for round, the manifest record, the check's parity rows, `bench`'s N and the
refusals; it also carries the export CLI's own checks (test_export.py and
test_export_archs.py run on the shared runtime_cases pairs, exported through the API).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from runtime_cases import _bias_target, prompts

from dflash_export.cli import cli as main
from dflash_export.export import draft_vocab as DV
from dflash_export.models import Drafter, Target, autoregressive_generate, new_drafter, speculative_generate
from dflash_export.runtime import contract as C, manifest as M
from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.models.tiny import make_drafter, make_target
from tiny_exports import exported_taps_error
from dflash_export.runtime.sampling import Sampling
from test_runtime_cli import char_tokenizer

# -- choosing the N tokens ----------------------------------------------------------------


def test_choose_by_count_keeps_stop_tokens_and_fills_by_id():
    counts = np.zeros(20, np.int64)
    counts[[9, 4, 13]] = [5, 7, 5]
    ids = DV.choose(6, 20, keep=[19], counts=counts)
    assert ids.tolist() == [0, 1, 4, 9, 13, 19]  # stop token, seen by count, then unseen by id
    assert DV.choose(3, 20, keep=[19], counts=counts).tolist() == [4, 9, 19]  # count order, ties by id
    assert DV.choose(4, 20, keep=[19]).tolist() == [0, 1, 2, 19]  # fallback: lowest ids
    assert DV.coverage(np.array([4, 9]), counts) == pytest.approx(12 / 17)


@pytest.mark.parametrize("n", [0, 1, 20, 25, -3])
def test_choose_refuses_bad_n(n):
    with pytest.raises(DFlashError, match="--draft-vocab"):
        DV.choose(n, 20, keep=[19])


def test_count_tokens_reads_jsonl_and_shards(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"tokens": [1, 2, 2]}) + "\n\n" + json.dumps({"ids": [3]}) + "\n")
    torch.save({"tokens": torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0]]), "start": 2, "length": torch.tensor([4, 3])},
               tmp_path / "shard-00000.pt")
    counts, source = DV.count_tokens([tmp_path / "a.jsonl", tmp_path], tmp_path, 12)
    assert counts.tolist() == [0, 1, 2, 1, 0, 0, 0, 1, 1, 1, 0, 0]  # shards: the generated part only
    assert "7 tokens" in source and "a.jsonl" in source


@pytest.mark.parametrize("content,match", [
    ('{"tokens": [1, 99]}\n', "outside the target's vocabulary"),
    ('{"foo": 1}\n', "'tokens' list"),
    ("not json\n", "'tokens' list"),
    ('{"tokens": []}\n', "no tokens found"),
])
def test_count_tokens_refuses_bad_data(tmp_path, content, match):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DFlashError, match=match):
        DV.count_tokens([tmp_path / "d.jsonl"], tmp_path, 12)


def test_text_data_without_tokenizer_is_refused(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello")
    with pytest.raises(DFlashError, match="no tokenizer.json"):
        DV.count_tokens([tmp_path / "corpus.txt"], tmp_path, 12)


# -- lossless on many random tiny pairs (PyTorch oracle) -----------------------------------


@pytest.mark.parametrize("arch,seed", [("llama", 1), ("qwen2", 2)])
def test_reduced_vocab_is_lossless(tmp_path, arch, seed):
    """Random pairs whose drafter scores N of V tokens (some with the target's favourite
    token, some without): speculative greedy == plain greedy on every prompt."""
    d = make_target(tmp_path / arch, arch=arch, seed=seed, layers=3, vocab=97)
    _bias_target(d, 2.0)  # the target favours token 7: real acceptance when 7 is in the N
    target = Target.from_pretrained(d, [0, 2])
    rng = np.random.default_rng(seed)
    accepted = {}
    for n in (8, 30):
        torch.manual_seed(seed)
        drafter = new_drafter(target.config, num_layers=1, target_layer_ids=[0, 2], block_size=5, mask_token_id=95)
        ids = np.sort(rng.choice(np.arange(8, 97), n - 1, replace=False)) if n == 30 else np.arange(n)
        ids = np.unique(np.append(ids, 96))  # the stop token is always kept
        drafter.set_draft_vocab(torch.from_numpy(ids), target.lm_head.weight)
        for p in prompts(3, 97, seed=seed):
            spec = speculative_generate(target, drafter, p, 20, mask_token_id=95, stop_token_ids=(96,))
            plain = autoregressive_generate(target, p, 20, stop_token_ids=(96,))
            assert spec.tokens == plain.tokens
            accepted[n] = accepted.get(n, 0) + sum(a - 1 for a in spec.acceptance_lengths)
        block = torch.tensor([[3] + [95] * 4])
        with torch.inference_mode():
            _, taps, _ = target(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], target.empty_kv())
            ctx = drafter.context_kv(taps, torch.arange(3)[None])
            logits = drafter.draft_logits(target, block, torch.arange(3, 8)[None], ctx)
        assert logits.shape == (1, 4, len(ids))
        assert set(drafter.draft_tokens(logits)[0].tolist()) <= set(ids.tolist())
    assert accepted[8] > 0, "token 7 is in the 8 lowest ids: drafts should be accepted somewhere"


# -- export, manifest, check, runtime, bench ------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A CLI export that carries the CLI's own checks too (test_cli_export_options): progress,
    --force over a stale file, the tokenizer file, and a sliding-window drafter made for
    block 4 exported with --block-size 6 (window 3: a masked block)."""
    root = tmp_path_factory.mktemp("dv")
    make_target(root / "t", "qwen2", layers=1, hidden=48, heads=2, kv_heads=1, intermediate=64, vocab=101,
                tie=True)  # tied: the block graph must hold the embedding only, under its one name
    _bias_target(root / "t", 2.0)
    char_tokenizer(root / "t" / "tokenizer.json")
    make_drafter(root / "d", root / "t", layers=1, block_size=4, sliding_window=3, layer_types=["sliding_attention"])
    data = root / "gen.jsonl"  # token counts in which 7 (the target's favourite) is frequent
    data.write_text("\n".join(json.dumps({"tokens": [7] * 5 + list(range(20 + i, 30 + i))}) for i in range(10)))
    (root / "out").mkdir()
    (root / "out" / "stale.txt").write_text("replaced by --force")
    r = CliRunner().invoke(main, ["export", "--target", str(root / "t"), "--draft", str(root / "d"),
                                  "--out", str(root / "out"), "--draft-vocab", "24", "--draft-vocab-data", str(data),
                                  "--max-context", "128", "--block-size", "6", "--force"])
    assert r.exit_code == 0, r.output
    (root / "progress.txt").write_text(r.stderr)
    return root


def test_cli_export_options(exported):
    """Progress on stderr; --force replaced the stale file and no temporary is left; the
    tokenizer travelled; --max-context and --block-size (over the drafter's 4) took effect;
    the tap is the target's only (last) layer, read after the final norm as transformers does."""
    progress = (exported / "progress.txt").read_text()
    assert "done" in progress and "validate" in progress and "total" in progress  # progress + sizes
    out = exported / "out"
    m = M.load_manifest(out)  # verifies every sha256
    assert not (out / "stale.txt").exists() and set(m.files) == {p.name for p in out.iterdir()} - {C.MANIFEST}
    assert [p.name for p in exported.iterdir() if p.name.startswith(".")] == []  # no temporary left
    assert m.tokenizer and (out / "tokenizer.json").read_bytes() == (exported / "t" / "tokenizer.json").read_bytes()
    assert (m.architecture, m.max_context, m.block_size) == ("Qwen2ForCausalLM", 128, 6)
    assert Drafter.from_pretrained(exported / "d").config.block_size == 4
    assert m.graphs[C.DRAFT_BLOCK].inputs[0].shape == ["batch", 6]
    assert m.target_layer_ids == [0] and m.target_layers == 1
    err = exported_taps_error(out, exported / "t")
    print(f"qwen2: taps [0] of 1 layer, max abs error {err:.2e}")
    assert err <= 1e-4


def test_manifest_records_n_and_source(exported):
    m = M.load_manifest(exported / "out")
    assert m.draft_vocab["size"] == 24 and "gen.jsonl" in m.draft_vocab["source"]
    assert m.draft_vocab["data_coverage"] > 0.5
    assert C.draft_vocab_size(m) == 24
    spec = {t.name: t for t in m.graphs[C.DRAFT_BLOCK].outputs}
    assert spec[C.DRAFT_LOGITS].shape[-1] == 24
    holds_head = [n for n, t in m.shared.items() if C.DRAFT_BLOCK in t.graphs]
    assert "lm_head.weight" not in holds_head and "embed_tokens.weight" in holds_head  # its own [N, H] head only


def test_check_parity_and_oracle_identity(exported):
    r = CliRunner().invoke(main, ["check", str(exported / "out"), "--target", str(exported / "t"),
                                  "--draft", str(exported / "d"), "--num-prompts", "6", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["draft_vocab"] == 24 and rep["passed"]
    rows = {(g, x["output"]) for g, xs in rep["graphs"].items() for x in xs}
    assert (C.DRAFT_BLOCK, C.DRAFT_LOGITS) in rows and (C.DRAFT_BLOCK, C.DRAFT_IDS) in rows
    assert rep["end_to_end"]["identical"] == 6


def test_runtime_lossless_and_round_for_round(exported):
    be = OrtBackend(exported / "out")
    assert be.graphs.tied_head_graphs == {C.TARGET}  # tied fp32 head, packed from the table (no folded copy)
    drafter = Drafter.from_pretrained(exported / "d")
    target = Target.from_pretrained(exported / "t", drafter.config.target_layer_ids)
    from dflash_export.export.check import draft_vocab_ids

    ids = draft_vocab_ids(exported / "out", be.manifest)
    assert len(ids) == 24 and 7 in ids and 100 in ids  # the frequent token and the stop token
    drafter.set_draft_vocab(torch.from_numpy(ids), target.lm_head.weight)
    accepted = 0
    for p in prompts(6, 101, seed=3):
        g = generate(be, p, 30)
        plain = generate(be, p, 30, draft=False)
        o = speculative_generate(target, drafter, p, 30, mask_token_id=be.manifest.mask_token_id,
                                 block_size=6, stop_token_ids=(100,))
        assert g.tokens == plain.tokens == o.tokens
        assert g.acceptance_lengths == o.acceptance_lengths
        accepted += sum(a - 1 for a in g.acceptance_lengths)
    assert accepted > 0
    # sampled: drafts from q over the N tokens (the manifest's ids, the graph's), rejection
    # sampling against p over all V; the oracle does the same with its own q
    assert be.samples_drafts and be.draft_vocab_ids.tolist() == ids.tolist()
    accepted = 0
    for seed, p in enumerate(prompts(4, 101, seed=5)):
        kw = dict(sampling=Sampling(0.9, top_k=30, seed=seed), stop_token_ids=(100,))
        g = generate(be, p, 30, **kw)
        o = speculative_generate(target, drafter, p, 30, mask_token_id=be.manifest.mask_token_id, block_size=6, **kw)
        assert g.tokens == o.tokens and g.acceptance_lengths == o.acceptance_lengths
        accepted += sum(a - 1 for a in g.acceptance_lengths)
    assert accepted > 0


def test_bench_reports_n(exported, tmp_path):
    pf = tmp_path / "p.txt"
    pf.write_text("1,2,3\n4,5\n")
    r = CliRunner().invoke(main, ["bench", str(exported / "out"), "--prompts", str(pf), "--max-new-tokens", "8",
                                  "--warmup", "0", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["draft_vocab"] == 24 and rep["lossless"]


def test_quantized_reduced_vocab_checks_against_its_dequantized_head(exported, tmp_path):
    """int4 with the drafter's layers: the [N, H] head is quantized too, and `check` holds
    the graphs to a reference with their own dequantized weights, that head included."""
    q = tmp_path / "q4"
    r = CliRunner().invoke(main, ["quantize", str(exported / "out"), "--out", str(q), "--quantize", "int4",
                                  "--quantize-draft", "--quant-accuracy-level", "0", "--quiet"])  # level 0: fp32
    # activations, so the dequantized reference is held to fp32 tolerances (auto's choice is timed, machine-dependent)
    assert r.exit_code == 0, r.output
    m = M.load_manifest(q)
    assert m.draft_vocab == M.load_manifest(exported / "out").draft_vocab
    assert "vocab_head" in m.quantization["weights"][C.DRAFT_BLOCK]
    r = CliRunner().invoke(main, ["check", str(q), "--target", str(exported / "t"), "--draft", str(exported / "d"),
                                  "--num-prompts", "4", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["passed"] and rep["draft_vocab"] == 24 and not rep["notes"], rep["notes"]
    rows = [x for x in rep["graphs"][C.DRAFT_BLOCK] if x["output"] == C.DRAFT_LOGITS and x["ref"] == "dequantized"]
    assert rows and all(x["tol"] and x["max"] <= x["tol"] for x in rows)
    assert rep["end_to_end"]["identical"] == 4


@pytest.mark.parametrize("args,match", [
    (["--draft-vocab", "101"], "between"),
    (["--draft-vocab", "1"], "between"),
    (["--draft-vocab-data", "x.jsonl"], "needs --draft-vocab"),
    (["--draft-vocab", "10", "--draft-vocab-data", "missing.jsonl"], "does not exist"),
])
def test_export_refuses_bad_draft_vocab(exported, tmp_path, args, match):
    out = tmp_path / "never"
    r = CliRunner().invoke(main, ["export", "--target", str(exported / "t"), "--draft", str(exported / "d"),
                                  "--out", str(out), "--quiet", *args])
    assert r.exit_code == 2 and match in r.output, r.output
    assert "Traceback" not in r.output and not out.exists()
    assert not list(tmp_path.glob(".never*"))


# -- room for the export, and what a killed export left ---------------------------------------


def test_room_check_refuses_with_a_hint_and_stale_staging_is_removed(exported, tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    from dflash_export.export import artifact

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".art.partial-{dead.pid}"  # a killed export's staging folder
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "target.data").write_bytes(b"x" * 10)
    running = tmp_path / f".art.partial-{os.getppid()}"  # an export still running: left alone
    running.mkdir()
    monkeypatch.setattr(artifact, "available_memory", lambda: 1000)
    args = ["export", "--target", str(exported / "t"), "--draft", str(exported / "d"), "--out", str(tmp_path / "art"),
            "--quiet"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "of memory" in r.output and "--no-room-check" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not stale.exists() and running.is_dir() and not (tmp_path / "art").exists()

    monkeypatch.setattr(artifact, "available_memory", lambda: None)  # unknown: no refusal on memory
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 10})())
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "free disk space" in r.output, r.output


def test_room_estimate_counts_safetensors_headers(exported):
    from dflash_export.export.artifact import checkpoint_elements

    target = Target.from_pretrained(exported / "t")
    params = {id(p): p.numel() for p in target.parameters()}
    assert checkpoint_elements(exported / "t") == sum(params.values())


def test_short_verifies_on_the_reduced_head(exported):
    """The reduced head (the graph's own [N, H]) scores only the drafts a verify uses: random short
    verifies stay lossless (batch 1 and 3) and rejection sampling over the N tokens draws as with
    every draft scored (tests/test_draft_head.py)."""
    from test_draft_head import _spy, lossless_short, sampled_short

    out = exported / "out"
    assert C.draft_index(OrtBackend(out).manifest)
    lossless_short(_spy(out), _spy(out, max_batch=3), 51)
    sampled_short(lambda **kw: _spy(out, **kw), n=2)
