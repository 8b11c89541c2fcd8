"""`generate --prompts FILE --batch N` and `bench --batch N`: many prompts through the
runtime's batched loop (runtime/measure.py `run_batch`, `bench_batch`), torch-free like cmd_run.
"""

from __future__ import annotations

import json

import click

from ..runtime.errors import DFlashError
from ..runtime.measure import batch_report, run_batch
from ..runtime.sampling import GREEDY, Sampling


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
