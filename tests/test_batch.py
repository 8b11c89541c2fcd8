"""Ragged batches through the runtime's one loop: every row's output is that prompt's own
batch-1 output, token for token, whatever else is in the batch.

Mixed prompt lengths, rows that stop early (a stop token, a short max_new_tokens), rows
that join late (more prompts than rows), with and without the drafter, adaptive verify
(rows verify different lengths in one call), a prompt prefilled in several chunks while
other rows hold context, every attention flavour and a hybrid (Gated DeltaNet) target.
The batch-1 reference is the same artifact's batch-1 backend, which tests/test_runtime.py
and tests/test_hybrid_runtime.py hold to the PyTorch oracle. Artifacts come from
tests/runtime_cases.py's cache (the same cases as those tests).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from runtime_cases import CASES, ORT_CASES, Case, artifact, prompts

from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.loop import Request, generate, generate_batch
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import VerifyPolicy
from dflash_export.runtime.sampling import Sampling

LIN, FULL = "linear_attention", "full_attention"
HYBRID = Case("qwen35", layers=3, draft_layers=1, block=6, bias=2.0, hidden=32, max_context=200,
              layer_types=(LIN, LIN, FULL))  # tests/test_hybrid_runtime.py's CASE
BATCH_CASES = {"qwen3": CASES["qwen3"], "llama": CASES["llama"], "qwen3-ort": ORT_CASES["qwen3-ort"],
               "llama-ort": ORT_CASES["llama-ort"], "hybrid": HYBRID}


def requests_for(be1: OrtBackend, n: int, seed: int, draft: bool) -> tuple[list[Request], list[list[int]]]:
    """n requests of mixed prompt lengths and lengths to generate; a third of them stop early
    on a token of their own greedy output (found on the batch-1 backend, which also gives
    the references)."""
    m = be1.manifest
    rng = np.random.default_rng(seed)
    reqs, refs = [], []
    for i, p in enumerate(prompts(n, m.vocab_size, seed=seed)):
        new = int(rng.integers(3, 24))
        stop: tuple[int, ...] = ()
        if i % 3 == 1:
            full = generate(be1, p, new, draft=draft, stop_token_ids=()).tokens
            stop = (full[min(len(full) - 1, 2)],)
        reqs.append(Request(p, new, stop_token_ids=stop))
        refs.append(generate(be1, p, new, draft=draft, stop_token_ids=stop).tokens)
    return reqs, refs


@pytest.mark.parametrize("name", list(BATCH_CASES))
def test_greedy_rows_equal_their_batch1_output(name):
    _, _, out = artifact(BATCH_CASES[name])
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    for draft in (True, False):
        reqs, refs = requests_for(be1, 8, seed=5, draft=draft)
        gens, stats = generate_batch(be3, reqs, draft=draft)
        got = [g.tokens for g in gens]
        assert got == refs, (name, draft)
        assert any(g.stopped for g in gens) and 0 < stats.occupancy <= 1 and stats.rounds > 0
        print(f"{name} draft={draft}: 8 requests over 3 rows identical to batch 1, "
              f"tau {np.mean([g.tau for g in gens if g.acceptance_lengths]):.2f}, occupancy {stats.occupancy:.2f}")


def test_adaptive_verify_and_chunked_prefill_in_a_batch():
    """Rows verify different lengths in one call (adaptive verify: a rejection-sampled row keeps
    its own, greedy rows verify up to the call's longest, since their padding is computed
    anyway), and a joining row's long prompt is prefilled in chunks over its own gathered past
    while the other rows wait."""
    _, _, out = artifact(CASES["qwen3"])
    be1, be4 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=4)
    policy = VerifyPolicy(theta=0.5, min_len=2)
    ps = prompts(6, be1.manifest.vocab_size, seed=3)
    ps[4] = ps[4] + ps[0] + ps[1]  # a longer prompt: several chunks of 7
    reqs = [Request(p, 30, stop_token_ids=()) for p in ps]
    reqs[2] = Request(ps[2], 30, Sampling(0.9, seed=5), stop_token_ids=())  # its output depends on its verify lengths
    alone = [generate(be1, q.prompt, 30, sampling=q.sampling, verify=policy, prefill_chunk=7,
                      stop_token_ids=()) for q in reqs]
    counts, real = [], be4.target_rows
    be4.target_rows = lambda rows, ids, n, *a, **k: counts.append(set(map(int, n))) or real(rows, ids, n, *a, **k)
    gens, _ = generate_batch(be4, reqs, verify=policy, prefill_chunk=7)
    assert [g.tokens for g in gens] == [g.tokens for g in alone]
    assert any(len(c) > 1 for c in counts)  # rows of one call verified different lengths (padding)
    assert gens[2].verify_lengths == alone[2].verify_lengths  # the sampled row: its own policy's lengths
    greedy = [i for i in range(6) if i != 2]
    assert sum(gens[i].tau for i in greedy) > sum(alone[i].tau for i in greedy)  # the padding verified drafts


@pytest.mark.parametrize("row_counts", [True, False], ids=["row-counts", "older-export"])
def test_ort_flavour_verify_calls(row_counts, tmp_path):
    """The ort flavour verifies a round's rows in one call, each row its own count of new
    tokens (GroupQueryAttention's query_seqlens, Manifest.row_counts). An export made before
    it verifies a row of several positions alone (GroupQueryAttention refuses several new
    tokens with a past at batch > 1 without the counts), the rows of a drafted round that
    verify their anchor alone (plain requests here) in one call, as a plain step does, and a
    row its own policy's length (not padded to the round's longest: there the padding would
    be computed, not free). Every row's tokens stay its batch-1 output."""
    _, _, out = artifact(ORT_CASES["qwen3-ort"])
    if not row_counts:  # as an older export: its manifest without row_counts
        old = tmp_path / "old"
        shutil.copytree(out, old)
        manifest = json.loads((old / "manifest.json").read_text())
        manifest.pop("row_counts")
        (old / "manifest.json").write_text(json.dumps(manifest))
        out = old
    be1, be4 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=4)
    assert be4.verify_per_row != row_counts
    policy = VerifyPolicy(theta=0.9, min_len=2)  # rows 2 and 3 verify different lengths
    spec = [False, False, True, True, False, True]  # rows 0 and 1 plain, rows 2 and 3 drafting
    ps = prompts(6, be1.manifest.vocab_size, seed=11)
    reqs = [Request(p, 10 + 5 * i, stop_token_ids=(), speculative=sp) for i, (p, sp) in enumerate(zip(ps, spec))]
    alone = [generate(be1, q.prompt, q.max_new_tokens, draft=q.speculative, verify=policy, stop_token_ids=()) for q in reqs]
    calls, real = [], be4._target_call
    be4._target_call = lambda rows, ids, *a, **k: calls.append((len(rows), ids.shape[1])) or real(rows, ids, *a, **k)
    gens, _ = generate_batch(be4, reqs, verify=policy)
    assert [g.tokens for g in gens] == [g.tokens for g in alone]
    if row_counts:  # rows verifying several positions together, in as many calls as rounds
        assert any(r > 1 and s > 1 for r, s in calls)
        return
    assert (2, 1) in calls and any(s > 1 for _, s in calls)  # two plain rows in one call; drafting rows verified alone
    assert len({gens[2].verify_lengths[0], gens[3].verify_lengths[0]}) > 1
    for q, g, a in zip(reqs, gens, alone):
        assert g.verify_lengths == (a.verify_lengths if q.speculative else [1] * len(g.verify_lengths))


def test_sampled_row_depends_only_on_its_seed():
    """A sampled request gives the same tokens alone and in a batch with other requests."""
    _, _, out = artifact(CASES["qwen3"])
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    ps = prompts(5, be1.manifest.vocab_size, seed=8)
    reqs = [Request(p, 20, Sampling(0.9, top_k=20, seed=100 + i), stop_token_ids=()) for i, p in enumerate(ps)]
    alone = [generate(be1, q.prompt, 20, sampling=q.sampling, stop_token_ids=()).tokens for q in reqs]
    gens, _ = generate_batch(be3, reqs)
    assert [g.tokens for g in gens] == alone
    assert len({tuple(t) for t in alone}) > 1


def test_batch_needs_a_ragged_export(tmp_path):
    """An export made before ragged batches loads and runs batch 1; --batch > 1 is one line."""
    _, _, out = artifact(CASES["llama"])
    old = tmp_path / "old"
    shutil.copytree(out, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest.pop("ragged")
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DFlashError, match="re-export"):
        OrtBackend(old, threads=1, max_batch=2)
    be = OrtBackend(out, threads=1, max_batch=2)
    with pytest.raises(DFlashError, match="at most 2 rows"):
        generate_batch(be, [Request([1, 2], 3)], batch=3)
    from dflash_export.runtime.manifest import load_manifest
    from dflash_export.runtime.ort.row_cache import check_batch

    with pytest.raises(DFlashError, match=r"CPU provider .* use --backend trt with engines from `dflash-export build OUT "
                                          r"--max-batch N`"):  # ORT's CUDA / TensorRT providers: the caches are host arrays
        check_batch(load_manifest(out), 2, "cuda", out)


def test_memory_check_refuses_a_batch_that_does_not_fit():
    from dflash_export.runtime.manifest import load_manifest
    from dflash_export.runtime.memory import cache_bytes_per_position, check_cache_memory

    _, _, out = artifact(CASES["llama"])
    m = load_manifest(out)
    row = m.max_context * cache_bytes_per_position(m)
    assert check_cache_memory(m, 4, m.max_context, available=5 * row) == 5 * row  # 4 rows + one gathered row
    with pytest.raises(DFlashError, match=r"--batch 4 x max context 256 needs .* GB of KV cache .* lower --batch"):
        check_cache_memory(m, 4, m.max_context, available=4 * row)


def test_cli_generate_prompts_in_batches(tmp_path):
    from click.testing import CliRunner

    from dflash_export.cli import cli

    _, _, out = artifact(CASES["qwen3"])
    ps = prompts(4, 100, seed=2)
    f = tmp_path / "p.txt"
    f.write_text("\n".join(",".join(map(str, p)) for p in ps) + "\n")
    r = CliRunner().invoke(cli, ["generate", str(out), "--prompts", str(f), "--batch", "3", "--max-new-tokens", "9",
                                 "--json", "--threads", "1"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    be = OrtBackend(out, threads=1)
    assert [x["tokens"] for x in lines] == [generate(be, p, 9).tokens for p in ps]
    for args, msg in ((["--batch", "0"], "--batch must be at least 1"), (["--batch", "2", "--prompt-ids", "1,2"],
                                                                         "--batch needs --prompts")):
        extra = [] if "--prompt-ids" in args else ["--prompts", str(f)]
        r = CliRunner().invoke(cli, ["generate", str(out), *extra, *args])
        assert r.exit_code != 0 and msg in r.output and "Traceback" not in r.output, r.output
