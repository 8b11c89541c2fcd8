"""`generate --prompts FILE --batch N` and `bench --batch N`: many prompts through the
runtime's batched loop (runtime/loop.py `stream_batch`), torch-free like cmd_run.

The bench runs the same requests at --batch N and at batch 1 in one process, interleaved
(N, 1, N, 1, ...), so the ratio of their aggregate rates is measured under the same load.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import numpy as np

from ..errors import DFlashError
from ..runtime.loop import BatchStats, Request, stream_batch
from ..runtime.sampling import GREEDY, Sampling

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


def generate_many(backend, tok, prompts: list[list[int]], max_new_tokens: int, batch: int, draft: bool, verify,
                  as_json: bool, control=None, sampling: Sampling = GREEDY,
                  stop_token_ids: tuple[int, ...] | None = None) -> None:
    """`generate --prompts`: one output line per prompt, in input order."""
    gens, stats = run_batch(backend, prompts, max_new_tokens, batch, draft=draft, verify=verify, control=control,
                            sampling=sampling, stop_token_ids=stop_token_ids)
    for i, g in enumerate(gens):
        text = tok.decode(g.tokens) if tok is not None else None
        if as_json:
            click.echo(json.dumps({"index": i, "tokens": g.tokens, "text": text, "tau": g.tau, "stopped": g.stopped,
                                   "tokens_per_second": len(g.tokens) / g.total_s if g.total_s > 0 else 0.0}))
        else:
            click.echo(text if text is not None else " ".join(map(str, g.tokens)))
    r = batch_report(gens, stats)
    click.echo(f"{r['requests']} prompts, batch {batch}: {r['new_tokens']} tokens in {r['wall_s']:.2f} s, "
               f"{r['aggregate_tokens_per_second']:.1f} tok/s aggregate, {r['per_request_tokens_per_second']:.1f} "
               f"tok/s per request, tau {r['tau']:.2f}, occupancy {r['mean_occupancy']:.2f}, rounds "
               f"{r['rounds'] - r['plain_rounds']} drafted / {r['plain_rounds']} plain [{backend.provider}]",
               err=True)


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


def echo_bench_batch(r: dict) -> None:
    click.echo(f"{r['requests']} requests x {r['max_new_tokens']} new tokens; batch {r['batch']} vs 1, "
               f"best of {r['repeats']} interleaved runs; {r['provider']}")
    for mode in ("speculative", "autoregressive"):
        m = r[mode]
        for key in (f"batch_{r['batch']}", "batch_1"):
            x = m[key]
            click.echo(f"{mode:>14} {key:>8}: {x['aggregate_tokens_per_second']:8.1f} tok/s aggregate "
                       f"({x['decode_tokens_per_second']:.1f} in the rounds), "
                       f"{x['per_request_tokens_per_second']:7.1f} tok/s per request, tau {x['tau']:.2f}, "
                       f"occupancy {x['mean_occupancy']:.2f}")
        click.echo(f"{mode:>14} batch {r['batch']} / batch 1: aggregate {m['aggregate_ratio']:.2f}x, "
                   f"in the rounds {m['decode_ratio']:.2f}x")


def check_batch_value(batch: int) -> int:
    if batch < 1:
        raise DFlashError(f"--batch must be at least 1 (got {batch})")
    return batch
