"""Prompt-prefix reuse in the batched loop (runtime/prefix.py, what `serve --max-batch` does):
rows that leave park their caches, later prompts that start with a parked sequence restore
it into whatever slot they get and prefill only the rest. Every output equals the same
request alone (batch 1, fresh prefill), token for token, with other rows joining, leaving
and moving slots around it; sampled rows keep their own seed's output."""

from __future__ import annotations

import pytest
from runtime_cases import CASES, KV8_CASES, ORT_CASES, artifact, prompts

from dflash_export.runtime.loop import Generation, Request, generate, stream_batch
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.prefix import PrefixCache, common, supported
from dflash_export.runtime.sampling import Sampling


def _turn(be, cache, specs):
    """specs: (prompt, max_new, speculative, temperature) joined one per round boundary, hooks
    made at join time (as the server's poll does). -> (tokens, Generation) per spec."""
    pending, outs, joined = list(range(len(specs))), [], []
    outs: list[Generation]

    def poll(free, idle):
        if not pending or not free:
            return []
        i = pending.pop(0)
        p, n, spec, temp = specs[i]
        hook = cache.hook(p, spec)
        joined.append(i)
        return [Request(p, n, Sampling(temp, seed=5), stop_token_ids=(), speculative=spec, reuse=hook.reuse,
                        prefix=hook)]

    got: dict[int, list[int]] = {}
    for index, tokens in stream_batch(be, [], outs=outs, poll=poll):
        got.setdefault(joined[index], []).extend(tokens)
    gen = {joined[i]: g for i, g in enumerate(outs)}
    return [(got[i], gen[i]) for i in range(len(specs))]


@pytest.mark.parametrize("case", [CASES["qwen3"], CASES["llama"], ORT_CASES["qwen3-ort"], ORT_CASES["llama-ort"],
                                  KV8_CASES["llama"]], ids=["standard", "standard-unbiased", "ort", "ort-unbiased", "ort-kv8"])
def test_parked_prefixes_are_reused_across_slots_and_every_output_equals_its_run_alone(case):
    _, _, out = artifact(case)
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    assert supported(be3) and not supported(be1)
    cache = PrefixCache(be3, entries=3, budget=1 << 30)
    V = be1.manifest.vocab_size
    ps = prompts(8, V, seed=21)

    def alone(p, n, spec, temp):
        return generate(be1, p, n, draft=spec, sampling=Sampling(temp, seed=5), stop_token_ids=()).tokens

    def rounds(p, n, spec, temp):
        return generate(be1, p, n, draft=spec, sampling=Sampling(temp, seed=5), stop_token_ids=()).acceptance_lengths

    # turn 1: four fresh requests over three rows (one plain, one sampled)
    t1 = [(ps[0], 12, True, 0.0), (ps[1], 9, False, 0.0), (ps[2], 14, True, 0.0), (ps[3], 10, True, 0.9)]
    r1 = _turn(be3, cache, t1)
    for s, (tokens, g) in zip(t1, r1):
        assert tokens == alone(*s) and g.reused < len(s[0])  # (random prompts may share a first token)
    assert 1 <= len(cache.kept) <= 3
    # turn 2: each kept conversation continued (prompt + answer + new words), one prompt that
    # shares only the first half of a kept prompt, one fresh
    kept = {tuple(e.tokens[:5]): e for e in cache.kept}
    t2 = []
    for i, ((p, n, spec, temp), (tokens, _)) in enumerate(zip(t1, r1)):
        if tuple(p[:5]) in kept:  # a plain row parks no drafter context: it continues plain
            t2.append((p + tokens + ps[4][:3], 10, spec and i != 0, temp))  # the first one continues plain
    half = next(e for e in reversed(cache.kept) if e.ctx_len).tokens
    t2 += [(half[: len(half) // 2] + ps[5][:4], 8, True, 0.0), (ps[6], 8, True, 0.0)]
    r2 = _turn(be3, cache, t2)
    for s, (tokens, g) in zip(t2, r2):
        assert tokens == alone(*s), s
        assert g.acceptance_lengths == rounds(*s), s  # the drafter's restored context drafts as its own
    reused = [g.reused for _, g in r2]
    assert all(r > 0 for r in reused[:-1]), reused  # every continued prompt found its prefix
    assert reused[-1] == 0
    assert reused[-2] <= len(half) // 2 + 4
    # turn 3: the second turns' conversations again: what they parked extends what was kept
    assert all(common(a.tokens, b.tokens) < min(len(a.tokens), len(b.tokens)) or a is b
               for a in cache.kept for b in cache.kept)  # no kept sequence is a prefix of another
    kept = [e for e in cache.kept if e.ctx_len]
    t3 = [(e.tokens + ps[7][:2], 6, True, 0.0) for e in kept]
    assert t3
    r3 = _turn(be3, cache, t3)
    for s, e, (tokens, g) in zip(t3, kept, r3):
        assert tokens == alone(*s) and g.reused == e.ctx_len > len(e.tokens) // 2, (g.reused, e.ctx_len)


def test_the_cache_keeps_its_bounds_and_can_be_turned_off():
    _, _, out = artifact(CASES["qwen3"])
    be = OrtBackend(out, threads=1, max_batch=2)
    ps = prompts(4, be.manifest.vocab_size, seed=3)
    cache = PrefixCache(be, entries=2, budget=1 << 30)
    _turn(be, cache, [(p, 6, True, 0.0) for p in ps])
    assert len(cache.kept) == 2
    small = PrefixCache(be, entries=4, budget=max(e.nbytes for e in cache.kept))
    _turn(be, small, [(p, 6, True, 0.0) for p in ps[:3]])
    assert len(small.kept) == 1 and small.nbytes <= small.budget
    off = PrefixCache(be, entries=0, budget=1 << 30)
    _turn(be, off, [(p, 6, True, 0.0) for p in ps[:2]])
    assert not off.kept
    hook = cache.hook(cache.kept[-1].tokens + [1], True, use=False)  # cache_prompt: false
    assert hook.reuse == 0 and hook.entry is None
    hook = cache.hook(cache.kept[-1].tokens + [1], True)
    assert hook.entry is cache.kept[-1] and hook.reuse == cache.kept[-1].ctx_len > 0
