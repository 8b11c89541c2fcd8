"""Running a real-size export on CPU: memory, prefill, decode and the drafter's share of a round.

    OMP_WAIT_POLICY=PASSIVE nice -n 15 .venv/bin/python bench/real_run.py ART [--threads 1,2] [--new-tokens 32]

For each thread count, a child process of its own (its peak RSS is its own) opens ART as
`generate` does (runtime/load.py open_artifact: runtime.json's settings, except the thread
count) and records: the load time and memory after load (RSS, anonymous memory, file pages
mapped from the artifact); the prefill of a 512-token random prompt (--prompt); plain
decoding (--new-tokens greedy tokens, speculation off: tokens/s); speculative decoding
with every round drafted (the same prompt; the drafter is untrained, so tau means nothing but
each call's cost does): the drafter's calls (draft_context + draft_block) as a fraction of a
round's graph time; and the peak RSS against the artifact's size and against `info`'s
estimate (runtime/memory.py run_memory). Prints a table and, last, one JSON line: the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import mem, parser, report, run_child, write_report


def child(art: Path, threads: int, prompt_len: int, new_tokens: int) -> dict:
    import numpy as np

    from dflash_export.runtime.load import open_artifact
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.memory import run_memory
    from dflash_export.runtime.settings import RunOptions

    t0 = time.perf_counter()
    backend, cfg = open_artifact(art, RunOptions(threads=threads))
    row = {"threads": threads, "load_s": round(time.perf_counter() - t0, 1), "after_load_mb": mem()}
    m = backend.manifest
    prompt = np.random.default_rng(0).integers(0, m.vocab_size - 2, prompt_len).tolist()
    chunk = backend.max_chunk

    plain = generate(backend, prompt, new_tokens, draft=False, prefill_chunk=chunk, stop_token_ids=())
    row |= {"prefill_tokens": prompt_len, "prefill_s": round(plain.prefill_s, 2),
            "prefill_tok_s": round(prompt_len / plain.prefill_s, 1),
            "plain_tok_s": round(len(plain.tokens) / plain.decode_s, 2),
            "plain_step_ms": round(1e3 * plain.decode_s / len(plain.tokens), 1)}
    spec = generate(backend, prompt, new_tokens, draft=True, prefill_chunk=chunk, stop_token_ids=(), verify=None)
    graph_s = spec.draft_s + spec.verify_s
    rounds = len(spec.acceptance_lengths)
    row |= {"spec_tok_s": round(len(spec.tokens) / spec.decode_s, 2), "tau_untrained": round(spec.tau, 2),
            "draft_ms_per_round": round(1e3 * spec.draft_s / rounds, 1),
            "verify_ms_per_round": round(1e3 * spec.verify_s / rounds, 1),
            "draft_fraction_of_round": round(spec.draft_s / graph_s, 3),
            "after_run_mb": mem()}
    artifact = sum((art / f).stat().st_size for f in m.files)
    est = run_memory(art, m, chunk=chunk)
    row |= {"artifact_mb": round(artifact / 2**20), "estimate_mb": round(est["total"] / 2**20),
            "peak_rss_mb": row["after_run_mb"]["VmHWM"],
            "peak_over_artifact": round(row["after_run_mb"]["VmHWM"] * 2**20 / artifact, 3)}
    return row


def main() -> None:
    ap = parser(__doc__, out="real_run.json")
    ap.add_argument("art", type=Path)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, one child each")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (prefill)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.art, a.child, a.prompt, a.new_tokens)))
        return
    rep = report(artifact=str(a.art), prompt=a.prompt, new_tokens=a.new_tokens, runs=[])
    for t in (int(x) for x in a.threads.split(",")):
        row = run_child(__file__, [str(a.art), "--child", str(t), "--prompt", str(a.prompt),
                                   "--new-tokens", str(a.new_tokens)])
        rep["runs"].append(row)
        print(f"threads {t}: load {row['load_s']} s, prefill {row['prefill_tok_s']} tok/s, plain {row['plain_tok_s']} tok/s "
              f"({row['plain_step_ms']} ms/step), drafter {100 * row['draft_fraction_of_round']:.0f}% of a round, "
              f"peak RSS {row['peak_rss_mb']} MiB = {row['peak_over_artifact']}x the artifact "
              f"(info's estimate {row['estimate_mb']} MiB)", file=sys.stderr)
    write_report(rep, a.out)
    print(json.dumps(rep["runs"]))


if __name__ == "__main__":
    main()
