"""Does the controller's cost model price a round as the loop runs it? Predicted against measured.

    nice -n 10 .venv/bin/python bench/round_model.py --art ART [--passes 3] [--configs 1,2,2+spin] [--prompts 6]

For each thread setting (`2+spin`: two threads, idle workers spinning) the calibration's pieces
run as `bench --calibrate` runs them (`round_costs` and `host_ms` at one row, the demo's verify
policy from ART's runtime.json when present), then the loop decodes the held-out demo prompts
(64 new tokens, greedy) drafting every round and plainly, and each round's wall time is set
against what the cost model charges it: a drafted round verifying s positions `spec_ms(1, s)`, a
plain round `plain_ms(1)` (under `auto`: the controller's host work included). The settings take
turns pass by pass (interleaved, so a change of the machine's load hits each alike); a pass
calibrates afresh. Prints, per setting, the median over passes of measured / predicted for the
median round of each kind (`drafted`, `plain_auto`, `plain`; `_p10`: the rounds' 10th
percentile, as the calibration takes its calls') and the whole run's sum, with the load
average before and after each pass. --ratios adds, per pass, `auto` (a controller on that
pass's costs) against plain decoding on the demo's 8 off-domain prompts and against `always`
on the code prompts, prompt by prompt in turn. One JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from common import ROOT, parser, report, write_report
from dflash_export.runtime.calibrate import cost_model, host_ms, round_costs
from dflash_export.runtime.controller import Controller, Costs, rounds_of
from dflash_export.runtime.load import open_backend, settings_for
from dflash_export.runtime.loop import generate
from dflash_export.runtime.measure import rate


def parse(label: str) -> tuple[int, bool]:
    t, _, spin = label.partition("+")
    return int(t), spin == "spin"


def one_pass(be, prompts: list[list[int]], verify, new: int, offdomain: list[list[int]] | None = None) -> dict:
    by = {1: round_costs(be, prompts[0], 1) | host_ms(be, prompts[0], 1, verify)}
    costs = Costs.from_json(cost_model(by))
    k = be.manifest.block_size
    never = Costs([1], [1.0], [[1.0] * k], [1e9], [0.0])
    ratios = {"drafted": [], "plain_auto": [], "plain": []}
    host = {"drafted": [], "plain_auto": [], "plain": []}
    whole = {"drafted": [0.0, 0.0], "plain_auto": [0.0, 0.0], "plain": [0.0, 0.0]}
    for p in prompts:
        runs = (("drafted", generate(be, p, new, verify=verify, stop_token_ids=())),
                ("plain_auto", generate(be, p, new, verify=verify, control=Controller(never, k), stop_token_ids=())),
                ("plain", generate(be, p, new, draft=False, stop_token_ids=())))
        for kind, g in runs:
            rounds = list(zip(g.round_s, g.verify_lengths))[:-1]  # the last round has no draft_context call
            for t, s in rounds:
                model = costs.spec_ms(1, s) if kind == "drafted" else costs.plain_ms(1) if kind == "plain_auto" else (
                    costs.plain_ms(1) - costs.host_ms(1, False))
                ratios[kind].append(sum(t) * 1e3 / model)
                host[kind].append((t[2] + (t[0] if kind != "drafted" else 0)) * 1e3)
                whole[kind][0] += sum(t) * 1e3
                whole[kind][1] += model
    out = {kind: float(np.median(r)) for kind, r in ratios.items()}
    out |= {f"{kind}_p10": float(np.percentile(r, 10)) for kind, r in ratios.items()}
    out |= {f"{kind}_host_ms": float(np.median(h)) for kind, h in host.items()}
    out |= {f"{kind}_sum": m / p for kind, (m, p) in whole.items()}
    if offdomain:  # the promise in the loop: auto against plain off the drafter's domain, against always on code
        for label, texts, other in (("off_domain_auto_over_never", offdomain, False), ("code_auto_over_always", prompts, True)):
            ctl, mine, theirs = Controller(costs, k), [], []
            for i, p in enumerate(texts):
                runs = [lambda: mine.append(generate(be, p, new, verify=verify, control=ctl)),
                        lambda: theirs.append(generate(be, p, new, verify=verify) if other else generate(be, p, new, draft=False))]
                for run in runs[:: 1 if i % 2 == 0 else -1]:  # the first alternating
                    run()
            out[label] = rate(mine) / rate(theirs)
            out[label.replace("_over_", "_drafted_") + "_rounds"] = rounds_of(mine)
    out["costs_ms"] = {"step": costs.step[0], "verify16": costs.verify[0][-1], "draft": costs.draft[0],
                       "context": costs.context[0], "host_draft": costs.host_draft[0], "host_plain": costs.host_plain[0]}
    return out


def main() -> None:
    ap = parser(__doc__, "round_model.json", json_flag=False)
    ap.add_argument("--art", type=Path, required=True, help="an export of the demo pair (dflash-export demo --out DIR: DIR/artifact)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--configs", default="1,2,1+spin,2+spin")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ratios", action="store_true", help="also auto/never on the demo's 8 off-domain prompts and "
                    "auto/always on the code prompts, each pass with its own calibration (the prompts' order alternating)")
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.art / "tokenizer.json"))
    texts = [json.loads(x)["prompt"] for x in (ROOT / "demo" / "prompts.jsonl").read_text().splitlines() if x.strip()]
    prompts = [tok.encode(t).ids for t in texts[: args.prompts]]
    off = [tok.encode(json.loads(x)["prompt"]).ids for x in (ROOT / "demo" / "prompts-offdomain.jsonl").read_text().splitlines()
           if x.strip()][:8] if args.ratios else None
    try:
        verify = settings_for(args.art).verify
    except Exception:  # noqa: BLE001: no calibration yet: the whole block
        verify = None
    labels = args.configs.split(",")
    backends = {c: open_backend(args.art, "ort", "cpu", threads=parse(c)[0], spin=parse(c)[1]) for c in labels}
    load = [round(os.getloadavg()[0], 1)]
    runs: dict = {c: [] for c in labels}
    for _ in range(args.passes):
        for c, be in backends.items():
            runs[c].append(one_pass(be, prompts, verify, args.max_new_tokens, off))
            load.append(round(os.getloadavg()[0], 1))
    out = report(verify=None if verify is None else vars(verify), load_1min=load, settings={})
    for c, passes in runs.items():
        keys = [k for k in passes[0] if k != "costs_ms" and not k.endswith("_rounds")]
        out["settings"][c] = {k: round(statistics.median(p[k] for p in passes), 3) for k in keys} | {
            "passes": [{k: v if isinstance(v, dict) else round(v, 3) for k, v in p.items() if k != "costs_ms"} for p in passes],
            "costs_ms": {k: round(v, 3) for k, v in passes[-1]["costs_ms"].items()}}
    print(json.dumps(out["settings"], indent=1))
    write_report(out, args.out)


if __name__ == "__main__":
    main()
