"""Log-probabilities from the loop (runtime/logprobs.py): the target's own, from the logits its
calls already return, unchanged by speculative decoding.

On several random tiny models (cached exports, tests/runtime_cases.py): a greedy speculative
run's per-token log-probabilities equal a plain run's within 1e-5 (same tokens), in a batch
as alone; the echoed prompt's and the first token's equal log_softmax of the PyTorch
target's logits over the whole sequence (1e-4, fp32); the chosen token's value equals its
top-1 value bit for bit when it is the argmax (lm-eval's is_greedy); an export without
`logits_index` is refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_cases import CASES, ORT_CASES, artifact, prompts

from dflash_export.runtime.errors import DFlashError
from dflash_export.runtime.logprobs import Logprobs, entries
from dflash_export.runtime.loop import Request, generate_batch
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.sampling import Sampling

LP_CASES = {"qwen3": CASES["qwen3"], "llama": CASES["llama"], "qwen2": CASES["qwen2"], "qwen3-ort": ORT_CASES["qwen3-ort"]}


def _run(be, prompt, n, draft, k=3, echo=False, **kw):
    lp = Logprobs(k=k, echo=echo)
    (g,), _ = generate_batch(be, [Request(prompt, n, stop_token_ids=(), logprobs=lp, **kw)], draft=draft)
    return g, lp


@pytest.mark.parametrize("name", list(LP_CASES))
def test_speculative_logprobs_equal_plain(name):
    _, _, out = artifact(LP_CASES[name])
    be = OrtBackend(out, threads=1)
    worst, accepted = 0.0, 0
    for p in prompts(4, be.manifest.vocab_size, seed=11):
        gs, ls = _run(be, p, 24, draft=True)
        gp, lpp = _run(be, p, 24, draft=False)
        assert gs.tokens == gp.tokens
        assert [e.token for e in ls.tokens] == gs.tokens and len(ls.tokens) == len(gs.tokens)
        for a, b in zip(ls.tokens, lpp.tokens):
            worst = max(worst, abs(a.logprob - b.logprob), *(abs(x[1] - y[1]) for x, y in zip(a.top, b.top)))
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.top[0][0] == a.token and a.logprob == a.top[0][1]  # greedy: the chosen is the top, same float
            assert a.logprob <= 0 and all(x[1] >= y[1] for x, y in zip(a.top, a.top[1:]))
        accepted += sum(x - 1 for x in gs.acceptance_lengths)
    print(f"{name}: speculative vs plain logprobs, worst |diff| {worst:.2e} ({accepted} drafts accepted)")
    assert worst <= 1e-5
    assert accepted > 0 or name == "llama"  # the biased targets (and qwen2) really accept drafts


def test_logprobs_in_a_batch_and_sampled_rows():
    """Rows of a batch get their batch-1 values; a sampled row's are the target's own
    (temperature 1, no top-k), whatever it samples with."""
    _, _, out = artifact(CASES["qwen3"])
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    ps = prompts(5, be1.manifest.vocab_size, seed=4)
    refs = [_run(be1, p, 12, draft=True)[1] for p in ps]
    lps = [Logprobs(k=2) if i % 2 == 0 else None for i in range(5)]
    gens, _ = generate_batch(be3, [Request(p, 12, stop_token_ids=(), logprobs=lp) for p, lp in zip(ps, lps)])
    for g, lp, ref in zip(gens, lps, refs):
        if lp is None:
            continue
        assert [e.token for e in lp.tokens] == g.tokens == [e.token for e in ref.tokens]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(lp.tokens, ref.tokens)) <= 1e-5
    g, lp = _run(be1, ps[0], 16, draft=True, sampling=Sampling(0.7, top_k=5, seed=3))
    g2, lp2 = _run(be1, ps[0], 16, draft=False, k=0, sampling=Sampling(0.7, top_k=5, seed=3))
    assert [e.token for e in lp.tokens] == g.tokens and all(e.top == [] for e in lp2.tokens)
    # each sampled token's value is log_softmax at temperature 1 of a target row: check against a plain rescoring
    g3, lp3 = _run(be1, ps[0] + g.tokens[:-1], 1, draft=False, echo=True)
    tail = lp3.prompt[len(ps[0]):]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lp.tokens, tail)) <= 1e-5


def test_echo_and_first_token_equal_transformers():
    """Every prompt token's log-probability (and the first generated one's) from a prefill in
    one call or in chunks equals log_softmax of transformers' logits for the same checkpoint and sequence."""
    import torch

    from dflash_export.models.tiny import hf_model

    tdir, _, out = artifact(CASES["llama"])
    be = OrtBackend(out, threads=1)
    hf = hf_model(tdir)
    worst = 0.0
    for i, p in enumerate(prompts(4, be.manifest.vocab_size, seed=9)):
        p = (p * 3)[:40]
        lp = Logprobs(k=4, echo=True)
        chunk = 7 if i % 2 else None  # chunks of 7, or the backend's (40 logits rows in one call)
        (g,), _ = generate_batch(be, [Request(p, 1, stop_token_ids=(), logprobs=lp)], prefill_chunk=chunk)
        seq = p + g.tokens
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1).numpy()
        assert lp.prompt[0] is None and len(lp.prompt) == len(p) and len(lp.tokens) == 1
        got = [e.logprob for e in lp.prompt[1:]] + [lp.tokens[0].logprob]
        want = [ref[i, t] for i, t in enumerate(seq[1:])]
        worst = max(worst, float(np.max(np.abs(np.array(got) - np.array(want)))))
        assert [t for t, _ in lp.prompt[5].top] == np.argsort(-ref[4], kind="stable")[:4].tolist()
    print(f"echo vs transformers' log_softmax: worst |diff| {worst:.2e}")
    assert worst <= 1e-4


def test_entries_equal_exact_top():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 50)).astype(np.float32) * 4
    tokens = x.argmax(-1).tolist()
    tokens[2] = int(np.argsort(x[2])[0])  # a token that is not the top
    es = entries(x, tokens, 5)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    for i, e in enumerate(es):
        assert abs(e.logprob - ref[i, tokens[i]]) < 1e-5
        assert [t for t, _ in e.top] == np.argsort(-x[i])[:5].tolist()
        assert (e.logprob == e.top[0][1]) == (i != 2)


def test_top_k_of_a_large_vocabulary_equals_a_full_sort():
    """The grouped search (runtime/logprobs.py _top) over 152k-wide rows, with ties and a tail."""
    rng = np.random.default_rng(1)
    for V in (151936, 50257, 20000):
        x = rng.normal(size=(5, V)).astype(np.float32)
        x[0, 10:40] = 9.0  # ties at the top, one group
        x[1, -3:] = 12.0  # the largest in the tail
        x[2, ::1000] = 7.0  # many groups tied
        for k in (1, 5, 20):
            es = entries(x, x.argmax(-1).tolist(), k)
            for i, e in enumerate(es):
                want = np.sort(x[i])[::-1][:k]
                assert np.allclose([v for _, v in e.top], want - want[0] + e.logprob, atol=1e-5)
                assert all(x[i, t] == v for (t, _), v in zip(e.top, want))
                assert e.logprob == e.top[0][1]


def test_old_export_refused_in_one_line():
    """An export without `logits_index` (made before ragged batches) is refused before any call."""
    _, _, out = artifact(CASES["qwen3"])
    be = OrtBackend(out, threads=1)
    be.manifest.ragged = False  # what an export made before ragged batches records

    def no_call(*a, **k):
        raise AssertionError("no call may run")

    be.target_rows = be.draft_context_rows = be.draft_block_rows = no_call
    with pytest.raises(DFlashError, match="re-export") as e:
        generate_batch(be, [Request([1, 2, 3], 2, logprobs=Logprobs(k=1))])
    assert "\n" not in str(e.value)
