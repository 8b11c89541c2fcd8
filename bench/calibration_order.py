"""Calibrated round costs against the rounds they price: each call timed where a round runs it
(runtime/calibrate.py round_costs) vs the calls repeated back to back (the calibration before).

    python bench/calibration_order.py DIR|MODEL ... [--prompts 3] [--max-new-tokens 64] [--threads 1] [--trials 3]

DIR: an export (the demo pair at block 8: `dflash-export export --target demo/pair/target --draft
demo/pair/draft --out /tmp/b8 --attention ort --block-size 8`, 40 s); MODEL: a bench/common.py
model, exported on first use (h1024: ~1 minute). The cache effect it is about needs a quiet
machine: on a 2-vCPU machine at load 3-4 other jobs evict the caches between any two calls,
and both orderings read the same. 3 trials of b8 and h1024 take ~3 minutes at 1 thread.

Per directory (ONNX Runtime, CPU, batch 1), interleaved in one loop `--trials` times: both cost
models, the loop drafting every round (full block), plain decoding, and `--speculation auto`
with each cost model (the two orderings' turns alternate from trial to trial). Reports, per round that ran, what each model predicts (at its verify
length) over what its graph calls took (median over rounds, and the 90th percentile: the rounds
other jobs disturbed least, comparable with the costs' 10th percentiles), and auto's tokens/s, drafted rounds and mean verify
length beside plain and always-drafting (medians over trials).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from common import BENCH_MODELS, ROOT, bench_model

from dflash_export.runtime import contract as C
from dflash_export.runtime.calibrate import _fill_rows, cost_model, round_costs
from dflash_export.runtime.controller import Controller, Costs
from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort.backend import OrtBackend


def back_to_back(backend, prompt: list[int], repeats: int = 21) -> dict:
    """round_costs as calibration measured before: the verifies of 1..K one after the other
    (verify 1 as the plain step), then the draft call, then the context call after a step."""
    k = backend.manifest.block_size
    repeats = max(1, min(repeats, (backend.max_len - len(prompt) - k) // 2))
    _fill_rows(backend, prompt, 1)
    ids = np.asarray((prompt * k)[:k], np.int64)[None]
    one = C.draft_index(backend.manifest) and k > 2
    times: dict = {s: [] for s in range(1, k + 1)} | {"draft": [], "context": [], "draft_one": []}
    clock = time.perf_counter
    for _ in range(1 + repeats):
        for s in range(1, k + 1):
            t0 = clock()
            backend.target_rows([0], ids[:, :s], [s], None)
            times[s].append(clock() - t0)
            backend.commit_rows([0], [0])
        for key, scored in (("draft", None), ("draft_one", 1)) if one else (("draft", None),):
            t0 = clock()
            backend.draft_block_rows([0], ids[:, 0], scored)
            times[key].append(clock() - t0)
        backend.target_rows([0], ids[:, :1], [1], None)
        backend.commit_rows([0], [1])
        t0 = clock()
        backend.draft_context_rows([0], [1])
        times["context"].append(clock() - t0)
    backend.reset()
    med = {key: float(np.percentile(ts[1:], 10)) * 1e3 for key, ts in times.items() if ts}
    return {"step": med[1], "verify": [med[s] for s in range(1, k + 1)], "draft": med["draft"],
            "context": med["context"], **({"draft_one": med["draft_one"]} if one else {})}


def ratios(costs: Costs, gens) -> list[float]:
    """Per round (the last of each generation left out: it has no draft_context call), what the
    cost model charges it (a drafted round at its verify length, a plain round a step) over what
    its graph calls took (wall; the loop's host code left out)."""
    out = []
    for g in gens:
        for (draft, verify, _), s, d in list(zip(g.round_s, g.verify_lengths, g.drafted))[:-1]:
            out.append((costs.spec_ms(1, s) if d else costs.plain_ms(1)) / ((draft + verify) * 1e3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="export directories or bench/common.py model names")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "demo" / "pair" / "target" / "tokenizer.json"))
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()[: a.prompts]
    texts = [tok.encode(json.loads(ln)["prompt"]).ids for ln in lines]
    dirs = {d: bench_model(d)[2] if d in BENCH_MODELS else Path(d) for d in a.dirs}
    load0 = os.getloadavg()
    bes = {d: OrtBackend(path, threads=a.threads, spin=False) for d, path in dirs.items()}
    ps = {d: [[t % be.manifest.vocab_size for t in p] for p in texts] for d, be in bes.items()}
    for d, be in bes.items():  # warm-up
        generate(be, ps[d][0], a.max_new_tokens, stop_token_ids=())
    rows: dict = {d: [] for d in bes}
    for trial in range(a.trials):
        print(f"trial {trial + 1} of {a.trials}, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
        for d, be in bes.items():
            k, p0 = be.manifest.block_size, ps[d][0]
            order = ("round order", "back to back")[:: 1 if trial % 2 else -1]  # each goes first in every other trial
            models = {m: round_costs(be, p0, 1) if m == "round order" else back_to_back(be, p0) for m in order}
            costs = {m: Costs.from_json(cost_model({1: c})) for m, c in models.items()}
            run = lambda **kw: [generate(be, p, a.max_new_tokens, stop_token_ids=(), **kw) for p in ps[d]]  # noqa: E731
            gens = {"always": run(), "plain": run(draft=False)}
            gens |= {f"auto, {m}": run(control=Controller(c, k)) for m, c in costs.items()}
            r = {"costs": models}
            for m, c in costs.items():
                r[f"predicted/measured, {m}"] = {kind: ratios(c, gens[kind]) for kind in ("always", "plain", f"auto, {m}")}
            for kind, gs in gens.items():
                dec = sum(g.decode_s for g in gs)
                r[kind] = {"tok_s": sum(len(g.tokens) - 1 for g in gs) / dec,
                           "drafted": sum(sum(g.drafted) for g in gs) / sum(len(g.drafted) for g in gs),
                           "verify_len": statistics.mean(s for g in gs for s, x in zip(g.verify_lengths, g.drafted) if x)
                           if any(any(g.drafted) for g in gs) else 0.0}
            rows[d].append(r)
    print(f"{a.threads} thread(s), {a.prompts} prompts x {a.max_new_tokens} tokens, {a.trials} trials (medians); "
          f"load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    med = statistics.median
    for d, rs in rows.items():
        print(f"{d} (block {bes[d].manifest.block_size}):")
        for m in ("back to back", "round order"):
            c = {key: (np.median([r["costs"][m][key] for r in rs], axis=0)) for key in rs[0]["costs"][m]}
            print(f"  costs {m} (medians over trials), ms: step {c['step']:.3f}, verify " + "/".join(f"{v:.2f}" for v in c["verify"])
                  + f", draft {c['draft']:.3f}" + (f" (one {c['draft_one']:.3f})" if "draft_one" in c else "")
                  + f", context {c['context']:.3f}")
            by = {kind: [x for r in rs for x in r[f"predicted/measured, {m}"][kind]] for kind in rs[0][f"predicted/measured, {m}"]}
            print(f"  predicted / measured round (graph calls), {m}, median and 90th percentile (the least disturbed "
                  "rounds): " + ", ".join(f"{kind} {med(x):.2f} {np.percentile(x, 90):.2f}" for kind, x in by.items()))
        for kind in ("plain", "always", "auto, back to back", "auto, round order"):
            print(f"  {kind}: {med(r[kind]['tok_s'] for r in rs):.0f} tok/s, drafted rounds "
                  f"{med(r[kind]['drafted'] for r in rs):.2f}, mean verify length {med(r[kind]['verify_len'] for r in rs):.2f}"
                  " (tok/s by trial " + ", ".join(f"{r[kind]['tok_s']:.0f}" for r in rs) + ")")
        pair = [r["auto, round order"]["tok_s"] / r["auto, back to back"]["tok_s"] for r in rs]
        print(f"  auto, round order / back to back tok/s: median {med(pair):.2f}, ahead in {sum(x > 1 for x in pair)} of "
              f"{len(pair)} trials")


if __name__ == "__main__":
    main()
