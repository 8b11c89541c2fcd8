"""Speculative vs plain decoding, measured the same way everywhere (`bench`, `demo`, bench/).

Both modes run on the same backend, prompt after prompt interleaved, so drifts in machine
load hit both alike. Decode rate = new tokens after the first / decode seconds (prefill
excluded); speedup = speculative rate / plain rate; ideal speedup = the speculative run's
tokens at the time its rounds' graph calls took (drafted rounds: draft + verify calls; the
controller's plain steps: the plain side's step) against the plain rate: the bound a loop
without host work would reach (with every round drafted: tau * step / (draft + verify)).
"""

from __future__ import annotations

import resource

import numpy as np

from .controller import rounds_of
from .loop import Generation, generate
from .sampling import Sampling

PHASES = ("prefill", "draft", "verify", "host", "total")


def rate(gs: list[Generation]) -> float:
    """Decode tokens per second over several generations (the prefill token not counted)."""
    return sum(len(g.tokens) - 1 for g in gs) / max(sum(g.decode_s for g in gs), 1e-12)


def summarize(spec: list[Generation], base: list[Generation], block_size: int, temperature: float = 0.0) -> dict:
    """The bench report of paired speculative / plain generations of the same prompts (sampled
    at `temperature` > 0: tau of rejection sampling; `lossless` is then None, as speculative
    and plain sampling draw different tokens from the same distribution)."""
    lengths = [a for g in spec for a, d in zip(g.acceptance_lengths, g.drafted or [True] * len(g.acceptance_lengths))
               if d]  # tau and its histogram: the drafted rounds (the controller's plain steps emit 1 each)
    steps = max(sum(len(g.acceptance_lengths) for g in base), 1)
    tau = float(np.mean(lengths)) if lengths else 0.0
    t_step = sum(g.verify_s for g in base) / steps
    drafted = [t for g in spec for t, d in zip(g.round_s, g.drafted or [True] * len(g.round_s)) if d] or [(0, 0, 0)]
    t_draft = sum(t[0] for t in drafted) / len(drafted)  # a drafted round's calls
    t_verify = sum(t[1] for t in drafted) / len(drafted)
    speedup = rate(spec) / max(rate(base), 1e-12)
    # the whole run as a loop without host work would run it: each drafted round its calls, each of
    # the controller's plain steps a plain step; `loop_efficiency` 1 means the loop adds nothing
    n = rounds_of(spec)
    ideal_s = n["drafted"] * (t_draft + t_verify) + n["plain"] * t_step
    ideal = sum(len(g.tokens) - 1 for g in spec) * t_step / ideal_s if ideal_s > 0 else 0.0
    split = lambda gs: {k: sum(getattr(g, f"{k}_s") for g in gs) for k in PHASES}  # noqa: E731
    return {
        "prompts": len(spec),
        "block_size": block_size,
        "tau": tau,
        "rounds": rounds_of(spec),  # the speculative side's rounds: drafted, or plain steps (the controller's)
        "mean_verify_len": float(np.mean([s for g in spec for s in g.verify_lengths])) if lengths else 0.0,
        "acceptance_histogram": {str(i): lengths.count(i) for i in range(1, block_size + 1)},
        "tokens_per_second": {"speculative": rate(spec), "autoregressive": rate(base)},
        "speedup": speedup,
        "ms_per_call": {"step": t_step * 1e3, "draft": t_draft * 1e3, "verify": t_verify * 1e3},
        "ideal_speedup": ideal,
        "loop_efficiency": speedup / ideal if ideal else 0.0,
        "time_split_s": {"speculative": split(spec), "autoregressive": split(base)},
        "temperature": temperature,
        "lossless": all(s.tokens == b.tokens for s, b in zip(spec, base)) if temperature == 0 else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }


def measure_many(backends: dict, prompts: list[list[int]], max_new_tokens: int, warmup: int = 1, verify=None,
                 temperature: float = 0.0, control=None, draft: bool = True) -> dict:
    """{label: (speculative runs, plain runs)} of several backends (e.g. thread counts) on the
    same prompts, interleaved prompt by prompt (sampled: seed = the prompt's index). The
    speculative side runs with `control` (runtime/controller.py; None: every round drafts)
    and `draft` (False: --speculation never, both sides plain)."""
    for be in backends.values():
        for p in prompts[:warmup]:
            generate(be, p, max_new_tokens, draft=draft, verify=verify, control=control)
            generate(be, p, max_new_tokens, draft=False)
    out = {label: ([], []) for label in backends}
    for p in prompts:
        for label, be in backends.items():
            kw = dict(sampling=Sampling(temperature, seed=len(out[label][0])))
            out[label][0].append(generate(be, p, max_new_tokens, draft=draft, verify=verify, control=control, **kw))
            out[label][1].append(generate(be, p, max_new_tokens, draft=False, **kw))
    return out


def run_bench(backend, prompts: list[list[int]], max_new_tokens: int, warmup: int = 1, verify=None) -> dict:
    """Speculative loop and plain decoding on the same prompts, same backend, same run."""
    spec, base = measure_many({0: backend}, prompts, max_new_tokens, warmup, verify)[0]
    report = summarize(spec, base, backend.manifest.block_size)
    draft_vocab = (backend.manifest.draft_vocab or {}).get("size")  # None: the drafter scores every token
    return {"provider": backend.provider, "max_new_tokens": max_new_tokens, "draft_vocab": draft_vocab, **report}


def off_domain_report(backend, prompts: list[list[int]], max_new_tokens: int, verify=None, temperature: float = 0.0,
                      control=None, draft: bool = True) -> dict:
    """Speculative against plain on prompts off the drafter's domain, no warm-up (the run before
    warmed up): the figures `bench` and `demo` report."""
    s = summarize(*measure_many({0: backend}, prompts, max_new_tokens, 0, verify, temperature, control, draft)[0],
                  backend.manifest.block_size, temperature)
    return {"prompts": len(prompts), **{k: s[k] for k in ("tau", "rounds", "tokens_per_second", "speedup", "lossless")}}


def random_text_prompts(tok, vocab_size: int, n: int, length: int = 128, seed: int = 0) -> list[str]:
    """Off-domain prompts as load generators make them (aiperf-style synthetic text): `length`
    token ids drawn uniformly from the vocabulary (special tokens left out) with numpy's
    default_rng(seed), decoded to a string; n of them."""
    special = set(tok.get_added_tokens_decoder()) if tok is not None else set()
    ids = np.array([i for i in range(vocab_size) if i not in special])
    rng = np.random.default_rng(seed)
    return [tok.decode(rng.choice(ids, length).tolist()) for _ in range(n)]
