"""Speculative vs plain decoding, measured the same way everywhere (`bench`, `demo`, bench/).

Both modes run on the same backend, prompt after prompt interleaved, so drifts in machine
load hit both alike. Decode rate = new tokens after the first / decode seconds (prefill
excluded); speedup = speculative rate / plain rate; ideal speedup = the speculative run's
tokens at the time its rounds' graph calls took (drafted rounds: draft + verify calls; the
controller's plain steps: the plain side's step) against the plain rate: the bound a loop
without host work would reach (with every round drafted: tau * step / (draft + verify)).

Batched runs (`bench --batch N`) take the same requests at N rows and at batch 1 in one
process, interleaved (N, 1, N, 1, ...), so the ratio of their aggregate rates is measured
under the same load.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from .controller import rounds_of
from .loop import BatchStats, Generation, Request, generate, stream_batch
from .sampling import GREEDY, Sampling

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


def batch_report(gens, stats) -> dict:
    """Aggregate and per-request rates of one batched run."""
    new = sum(len(g.tokens) for g in gens)
    lengths = [a for g in gens for a in g.acceptance_lengths]
    per_request = [len(g.tokens) / g.total_s for g in gens if g.total_s > 0]
    return {
        "requests": len(gens),
        "new_tokens": new,
        "wall_s": stats.wall_s,
        "aggregate_tokens_per_second": new / max(stats.wall_s, 1e-12),
        # the rounds alone: tokens after each request's first (which its prefill makes) over the rounds' time
        "decode_tokens_per_second": (new - len(gens)) / max(stats.decode_s, 1e-12),
        "per_request_tokens_per_second": float(np.mean(per_request)) if per_request else 0.0,
        "tau": float(np.mean(lengths)) if lengths else 0.0,
        "rounds": stats.rounds,
        "plain_rounds": stats.plain_rounds,  # rounds that drafted nothing
        "mean_occupancy": stats.occupancy,
        "time_s": {"prefill": stats.prefill_s, "rounds": stats.decode_s},
    }


def run_batch(backend, prompts: list[list[int]], max_new_tokens: int, batch: int, *, draft: bool = True,
              verify=None, control=None, sampling: Sampling = GREEDY,
              stop_token_ids: tuple[int, ...] | None = None) -> tuple[list, object]:
    """All prompts through `stream_batch` at `batch` rows -> (Generations in prompt order, BatchStats).
    Generation.total_s of each request is its wall time from joining to finishing."""
    stats, outs, order, start, done = BatchStats(), [], [], {}, {}
    reqs = [Request(p, max_new_tokens, sampling, stop_token_ids) for p in prompts]
    t0 = time.perf_counter()
    for i, _ in stream_batch(backend, reqs, batch=batch, draft=draft, verify=verify, outs=outs, stats=stats,
                             control=control):
        now = time.perf_counter()
        if len(order) < len(outs):
            order.append(i)
            start[i] = now - outs[-1].prefill_s
        done[i] = now
    by = dict(zip(order, outs))
    for i, g in by.items():
        g.total_s = done[i] - start[i]
    stats.wall_s = time.perf_counter() - t0
    return [by[i] for i in range(len(prompts))], stats


def bench_batch(open_, prompts: list[list[int]], n: int, batch: int, warmup: int, verify, repeats: int = 2,
                control=None, draft: bool = True) -> dict:
    """Speculative and plain decoding of the requests at `batch` rows and at batch 1, interleaved;
    `open_(max_batch)` opens a backend. Requests: the prompts, repeated to 2 x batch when fewer."""
    reqs = [prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * batch))]
    backends = {batch: open_(batch), 1: open_(1)}
    for be in backends.values():
        for d in (True, False):
            for _ in range(warmup):
                run_batch(be, reqs[: be.max_batch], n, be.max_batch, draft=d and draft, verify=verify,
                          control=control if d else None)
    runs = {(b, d): [] for b in backends for d in (True, False)}
    for _ in range(repeats):
        for d in (True, False):
            for b, be in backends.items():
                gens, stats = run_batch(be, reqs, n, b, draft=d and draft, verify=verify, control=control if d else None)
                runs[b, d].append(batch_report(gens, stats))
    out = {"batch": batch, "requests": len(reqs), "max_new_tokens": n, "repeats": repeats,
           "provider": backends[batch].provider}
    for d, mode in ((True, "speculative"), (False, "autoregressive")):
        best = {b: max(runs[b, d], key=lambda r: r["aggregate_tokens_per_second"]) for b in backends}
        out[mode] = {f"batch_{b}": r for b, r in best.items()}
        for key in ("aggregate", "decode"):
            out[mode][f"{key}_ratio"] = (best[batch][f"{key}_tokens_per_second"]
                                         / max(best[1][f"{key}_tokens_per_second"], 1e-12))
    for be in backends.values():
        be.close()
    return out
