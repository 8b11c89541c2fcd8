"""What `--speculation auto` does on a Qwen3-30B-A3B-shaped MoE target, whose verify cost grows with its length.

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python bench/moe_policy.py --art ART [--prompts 2 --new 128]

ART: an export of bench/moe_export.py's checkpoint (Qwen3-30B-A3B's layer shape at reduced
depth, random weights, a random 1-layer drafter), e.g.
`dflash-export export --target WORK/target --draft WORK/draft --out ART --moe op --max-context 1024`.
In one process, on 2 ORT threads:

1. Costs: `round_costs` (what `bench --calibrate` writes to runtime.json) after a prompt run
   through the model (its routing, not uniform random ids at the experts): a plain step, a
   verify of every length 1..16, a draft, a context update; with the break-even of each length.
2. A drafter that accepts nothing (the random drafter): plain decoding against `auto` with
   those costs, prompt after prompt interleaved (the order rotating), one controller for all
   prompts (as `serve` has); per prompt too (the first is the cold one). On a loaded machine
   the runs' wall times drift apart by more than the drafted rounds cost, so also: the
   median round time of each kind and the ratio at those medians (auto's rounds counted as
   they ran, each at its kind's median time, against as many tokens at its plain rounds'
   median: plain decoding's step as the same run saw it).
   The full block every round, `always`, on the first prompt's first --always-new tokens only
   (it is the slow one; 0: not run).
3. An acceptance profile like the demo pair's, replayed against the measured costs: the demo
   drafter's full-block acceptance histogram (demo/RESULTS.md) as independent rounds, and the
   demo pair's recorded rounds (tests/fixtures/speculation_traces.json, in-domain prompts); a round
   verifying s positions emits min(recorded, s). Tokens per ms of `auto` (the controller's
   verify lengths; one controller over the requests), of the full block every round, and of
   plain steps.
Prints one JSON object. Not part of the test suite (minutes, GBs of memory).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from common import machine, random_prompts, uptime

from dflash_export.runtime.calibrate import cost_model, round_costs
from dflash_export.runtime.controller import Controller, Costs, auto_policy
from dflash_export.runtime.loop import Generation, generate
from dflash_export.runtime.ort.backend import OrtBackend

ROOT = Path(__file__).resolve().parents[1]
DEMO_HISTOGRAM = [188, 124, 66, 38, 50, 24, 29, 31, 8, 14, 9, 3, 6, 6, 4, 53]  # demo/RESULTS.md, block 16


def rate(gens) -> float:
    return sum(len(g.tokens) - 1 for g in gens) / sum(g.decode_s for g in gens)


def live(be: OrtBackend, costs: Costs, prompts: list, new: int, always_new: int, fresh: bool) -> dict:
    """Plain against auto (and always: first prompt, always_new tokens) with the random drafter,
    prompt after prompt interleaved; auto's one controller serves every prompt, as in `serve` or
    `generate --prompts` (a new request starts from the recent record: runtime/controller.py)."""
    k = be.manifest.block_size
    generate(be, prompts[0][:8], 2, draft=False)  # warm the shapes up
    ctl = Controller(costs, k)
    plain, auto, always, alone = [], [], [], []
    runs = [lambda p: plain.append(generate(be, p, new, draft=False)),
            lambda p: auto.append(generate(be, p, new, control=ctl))]
    if fresh:  # auto with a controller of its own per prompt: every prompt cold
        runs.append(lambda p: alone.append(generate(be, p, new, control=Controller(costs, k))))
    for i, p in enumerate(prompts):
        for run in runs[i % len(runs):] + runs[: i % len(runs)]:  # the order rotates: load drifts
            run(p)
        if i == 0 and always_new:
            always.append(generate(be, p, always_new))
    assert all(a.tokens == b.tokens for a, b in zip(auto, plain))  # lossless

    def median_ms(gens, kind: bool) -> float:  # the median round time of one kind (draft + verify + host)
        t = [sum(s) for g in gens for s, d in zip(g.round_s, g.drafted) if d == kind]
        return 1e3 * float(np.median(t)) if t else 0.0

    def accounted(gens) -> float:
        """Tokens per ms of these runs' rounds at their kind's median time, over a plain step's
        (their own plain rounds' median): the ratio without the load's drift between runs."""
        d, step = sum(sum(g.drafted) for g in gens), median_ms(gens, False)
        ms = (sum(len(g.drafted) for g in gens) - d) * step + d * median_ms(gens, True)
        return sum(sum(g.acceptance_lengths) for g in gens) * step / ms

    out = {"tokens_per_second": {"plain": rate(plain), "auto": rate(auto)}, "auto_over_plain": rate(auto) / rate(plain),
           "auto_rounds": {"drafted": sum(sum(g.drafted) for g in auto),
                           "plain": sum(len(g.drafted) - sum(g.drafted) for g in auto)},
           "per_prompt": [{"auto_over_plain": rate([a]) / rate([b]), "drafted_rounds": sum(a.drafted)}
                          for a, b in zip(auto, plain)],
           "median_round_ms": {"plain decoding": median_ms(plain, False), "auto plain": median_ms(auto, False),
                               "auto drafted": median_ms(auto, True)},
           "auto_over_plain_at_median_rounds": accounted(auto)}
    if alone:
        assert all(a.tokens == b.tokens for a, b in zip(alone, plain))
        out["auto_fresh_per_prompt"] = {"over_plain": rate(alone) / rate(plain),
                                        "drafted_rounds": sum(sum(g.drafted) for g in alone),
                                        "over_plain_at_median_rounds": accounted(alone)}
    if always:
        assert always[0].tokens == plain[0].tokens[: len(always[0].tokens)]
        out["always_first_prompt"] = {"tokens_per_second": rate(always), "over_plain": rate(always) / rate(plain[:1]),
                                      "tau": float(np.mean(always[0].acceptance_lengths))}
    return out


def replay(accept, n: int, mode: str, costs: Costs, k: int, ctl: Controller) -> tuple[int, float, float]:
    """(tokens, ms, mean verify length of drafted rounds) of one n-token request whose drafted
    round at position t would emit accept(t) tokens verifying the full block (`ctl`: auto's
    controller, serving request after request)."""
    row = SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
    t, spent, last, lengths = 0, 0.0, None, []
    while t < n:
        spec = mode == "always" or (mode == "auto" and ctl.decide([row], None))
        s = (row.ctl.cap or k if mode == "auto" else k) if spec else 1
        a = min(accept(t), s, n - t) if spec else 1
        row.gen.acceptance_lengths.append(a)
        row.gen.verify_lengths.append(s)
        row.gen.drafted.append(spec)
        catch_up = costs.context[0] if spec and last is False else 0.0  # the plain steps' context
        spent += costs.spec_ms(1, s) + catch_up if spec else costs.plain_ms(1)
        lengths += [s] if spec else []
        t, last = t + a, spec
    return t, spent, float(np.mean(lengths)) if lengths else 0.0


def profiles(n: int, requests: int) -> dict:
    """{name: [accept(t) per request]}: the demo histogram (independent rounds, seeded) and the recorded rounds."""
    p = np.array(DEMO_HISTOGRAM, float) / sum(DEMO_HISTOGRAM)
    draws = [np.random.default_rng(i).choice(16, size=n, p=p) + 1 for i in range(requests)]
    hist = [lambda t, d=d: int(d[t]) for d in draws]
    traces = json.loads((ROOT / "tests" / "fixtures" / "speculation_traces.json").read_text())["sets"]["held-out"]

    def recorded(rounds):
        def at(t):  # the recorded round covering t, from t on
            pos = 0
            for a, _ in rounds:
                if pos <= t < pos + a:
                    return a - (t - pos)
                pos += a
            return 1
        return at
    return {"demo histogram (full block, tau 4.7)": hist, "demo recorded rounds (in-domain)": [recorded(r) for r in traces]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--art", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--always-new", type=int, default=24, help="tokens of the one full-block-every-round run")
    ap.add_argument("--fresh", action="store_true", help="also auto with a new controller per prompt (each cold)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="passes over every call for the costs")
    args = ap.parse_args()
    report = {"machine": machine(), "threads": args.threads, "load_before": uptime()}
    be = OrtBackend(args.art, threads=args.threads)
    m = be.manifest
    report["target"] = {"layers": m.target_layers, "hidden": m.hidden_size, "vocab": m.vocab_size, "block": m.block_size,
                        "quantization": (m.quantization or {}).get("scheme")}
    prompts = random_prompts(args.prompts, 32, m.vocab_size, seed=1)
    t0 = time.perf_counter()
    by_rows = {1: round_costs(be, prompts[0], 1, repeats=args.repeats)}
    costs = Costs.from_json(cost_model(by_rows))
    report["costs_ms"] = {"step": by_rows[1]["step"], "verify_by_length": by_rows[1]["verify"],
                          "draft": by_rows[1]["draft"], "context": by_rows[1]["context"],
                          "seconds": time.perf_counter() - t0}
    report["auto_policy"] = auto_policy(costs, m.block_size)
    print(json.dumps({"costs_ms": report["costs_ms"], "auto_policy": report["auto_policy"]}), flush=True)
    report["accepts_nothing"] = live(be, costs, prompts, args.new, args.always_new, args.fresh)
    print(json.dumps({"accepts_nothing": report["accepts_nothing"]}), flush=True)
    replayed = {}
    for name, reqs in profiles(128, 24).items():
        res = {}
        for mode in ("auto", "always", "never"):
            ctl = Controller(costs, m.block_size)  # one controller for the requests, as a server has
            res[mode] = [replay(a, 128, mode, costs, m.block_size, ctl) for a in reqs]
        r = {mode: sum(x[0] for x in v) / sum(x[1] for x in v) for mode, v in res.items()}
        replayed[name] = {"auto_over_plain": r["auto"] / r["never"], "full_block_over_plain": r["always"] / r["never"],
                          "auto_over_full_block": r["auto"] / r["always"],
                          "auto_mean_verify_len": float(np.mean([x[2] for x in res["auto"]]))}
    report["replayed"] = replayed
    report["load_after"] = uptime()
    be.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
