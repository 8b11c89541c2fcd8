"""The speculation controller replayed over recorded runs, without the machine's noise (runtime/replay.py).

    nice -n 10 .venv/bin/python bench/speculation_replay.py --record --art ART [--threads 1]
    .venv/bin/python bench/speculation_replay.py [--traces tests/fixtures/speculation_traces.json]

--record decodes two prompt sets with ART (an export of the demo pair), drafting every round
with the demo's verify policy (ART's calibrated one, else confident prefix theta 0.05, at
least 3), greedy, 128 new tokens: `held-out` (demo/prompts.jsonl, code) and `off-domain`
(demo/prompts-offdomain.jsonl, 24 random-vocabulary texts; the first 8 are the demo's
off-domain row and `bench`'s synthetic prompts, runtime/measure.py random_text_prompts seed
0). Each prompt's rounds are kept as (tokens emitted, positions verified), with the cost model
calibrated on this machine now (`round_costs` and `host_ms` at one row, as `bench
--calibrate` measures them: `costs.recorded`), the load average and the date; written to
--traces (other cost models may be added under `costs` by hand, with their source). The tests
replay that file (tests/test_controller.py), so a change of the decision rule that loses the
promise fails them.

Without --record: prints, per set, tokens per unit of time of `auto` against `always` and
`never`, and the share of rounds `auto` drafted, at each cost model of the file and with drafted
rounds 20% dearer than calibrated (decided on the calibration; the controller's measured
correction learns the difference as in a real run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from dflash_export.runtime.controller import Costs
from dflash_export.runtime.replay import replay

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "fixtures" / "speculation_traces.json"
SETS = {"held-out": "prompts.jsonl", "off-domain": "prompts-offdomain.jsonl"}


def record(art: Path, threads: int, new: int) -> dict:
    from dflash_export.runtime.calibrate import cost_model, host_ms, round_costs
    from dflash_export.runtime.load import open_backend, settings_for
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.settings import RunOptions, VerifyPolicy

    be = open_backend(art, "ort", "cpu", threads=threads)
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    verify = settings_for(art, RunOptions(threads=threads)).verify or VerifyPolicy(0.05, 3)
    ids = {name: [tok.encode(json.loads(x)["prompt"]).ids[: be.max_len - new]
                  for x in (ROOT / "demo" / f).read_text().splitlines() if x.strip()] for name, f in SETS.items()}
    load = [os.getloadavg()[0]]
    first = ids["held-out"][0]
    costs = cost_model({1: round_costs(be, first, 1) | host_ms(be, first, 1, verify)})
    sets = {}
    for name, ps in ids.items():
        gens = [generate(be, p, new, verify=verify) for p in ps]
        sets[name] = [[[a, s] for a, s in zip(g.acceptance_lengths, g.verify_lengths)] for g in gens]
        print(f"{name}: {len(gens)} prompts, tau {np.mean([a for g in gens for a in g.acceptance_lengths]):.2f}", flush=True)
    load.append(os.getloadavg()[0])
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    return {"recorded": f"{when}, {os.cpu_count()} vCPUs, {threads} ORT thread(s), load average {load[0]:.1f}-"
                        f"{load[1]:.1f}, {art}", "block_size": be.manifest.block_size, "verify": vars(verify),
            "max_new_tokens": new, "costs": {"recorded": costs}, "sets": sets}


def never_ms(costs: dict) -> float:
    """A round of plain decoding at one row: the step and the loop's host work without a controller."""
    return costs["step_ms"][0] + costs.get("host_step_ms", [0.0])[0]


def dearer(c: Costs, f: float) -> Costs:
    """The same costs with a drafted round's calls f times dearer (host work and steps as they were)."""
    return Costs(c.rows, c.step, [[v * f for v in vs] for vs in c.verify], [d * f for d in c.draft], c.context,
                 draft_one=c.draft_one and [d * f for d in c.draft_one], host_draft=c.host_draft, host_plain=c.host_plain)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--record", action="store_true", help="record the traces with --art (overwrites --traces)")
    ap.add_argument("--art", type=Path, help="an export of the demo pair (with --record)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.record:
        if not args.art:
            raise SystemExit("error: --record needs --art ART (an export of the demo pair)")
        args.traces.write_text(json.dumps(record(args.art, args.threads, args.max_new_tokens)) + "\n")
    d = json.loads(args.traces.read_text())
    k = d["block_size"]
    print(f"recorded: {d['recorded']}")
    for label, raw in d["costs"].items():
        costs = Costs.from_json(raw)
        print(f"costs {label}: break-even at the block {costs.ratio(1, k):.2f} tokens")
        for f in (1.0, 1.2):
            for name, traces in d["sets"].items():
                r = {m: replay(traces, m, costs, dearer(costs, f), never_ms(raw), k) for m in ("auto", "always", "never")}
                print(f"  drafted rounds x{f}: {name}: auto/always {r['auto'].rate / r['always'].rate:.3f}, auto/never "
                      f"{r['auto'].rate / r['never'].rate:.3f}, always/never {r['always'].rate / r['never'].rate:.3f}, "
                      f"auto drafted {r['auto'].drafted} of {r['auto'].drafted + r['auto'].plain} rounds")


if __name__ == "__main__":
    main()
