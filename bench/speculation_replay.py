"""The speculation controller replayed against a cost model, without the machine's noise.

    .venv/bin/python bench/speculation_replay.py --art ART [--traces bench/results/speculation_traces.json]

1. Records each prompt's round-by-round acceptance and verify length from a speculative run
   that drafts every round with ART's calibrated verify policy (`--verify full`: the whole
   block) (demo/prompts.jsonl and demo/prompts-offdomain.jsonl, 128 new tokens, greedy).
2. Replays the controller over each recording: a drafted round starting at position t
   verifies the length of the recorded round covering t and accepts what that round accepted
   from t on (the whole recorded round when it starts there), a plain step advances one
   position; time is charged from ART's calibrated round costs (runtime.json), and again
   with drafted rounds 20% dearer than calibrated (decisions still from the calibration).
   `--host F` adds F plain steps of per-round host work (sampling, acceptance, the server's
   streaming) to every round of both kinds, in the decisions' costs too (what the
   controller's measured correction learns in a real loop): plain rounds then cost
   relatively more than the bare calls the calibration timed.
Prints tokens per unit of time of auto against always and never for both prompt sets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from tokenizers import Tokenizer

from dflash_export.runtime.controller import Controller, Costs
from dflash_export.runtime.load import open_artifact
from dflash_export.runtime.loop import Generation, generate

ROOT = Path(__file__).resolve().parents[1]
SETS = ("prompts.jsonl", "prompts-offdomain.jsonl")


def record(art: Path, new: int, verify: str) -> dict:
    be, cfg = open_artifact(art, verify=verify)
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    out = {}
    for name in SETS:
        texts = [json.loads(x)["prompt"] for x in (ROOT / "demo" / name).read_text().splitlines() if x.strip()]
        gens = [generate(be, tok.encode(t).ids, new, verify=cfg.verify) for t in texts]
        out[name] = [[list(x) for x in zip(g.acceptance_lengths, g.verify_lengths)] for g in gens]
    return out


def accepted_at(rounds: list, t: int) -> tuple[int, int]:
    """(tokens, verify length) of a drafted round at position t: the recorded round covering t, from t on."""
    p = 0
    for a, s in rounds:
        if p <= t < p + a:
            return (a if t == p else p + a - t), s
        p += a
    return 1, 1


def replay(rounds: list, mode: str, decide: Costs, charge: Costs, k: int) -> tuple[int, float]:
    ctl = Controller(decide, k)
    row = SimpleNamespace(req=SimpleNamespace(speculative=True), ud=None, ctl=None, gen=Generation(), done=False)
    t, spent, n, last = 0, 0.0, sum(a for a, _ in rounds), None
    while t < n:
        spec = mode == "always" or (mode == "auto" and ctl.decide([row], None))
        a, s = accepted_at(rounds, t) if spec else (1, 1)
        a = min(a, n - t)
        row.gen.acceptance_lengths.append(a)
        row.gen.verify_lengths.append(s)
        row.gen.drafted.append(spec)
        catch_up = charge.context[0] if spec and last is False else 0.0
        spent += charge.spec_ms(1, s) + catch_up if spec else charge.plain_ms(1)
        t, last = t + a, spec
    return n, spent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--art", type=Path, required=True)
    ap.add_argument("--traces", type=Path, help="recordings to reuse (written there when missing)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--verify", default="auto", help="auto: the calibrated verify policy; full: the whole block")
    ap.add_argument("--host", type=float, default=0.0, help="per-round host work, in calibrated plain steps")
    args = ap.parse_args()
    if args.traces and args.traces.is_file():
        traces = json.loads(args.traces.read_text())
    else:
        traces = record(args.art, args.max_new_tokens, args.verify)
        if args.traces:
            args.traces.write_text(json.dumps(traces) + "\n")
    entry = json.loads((args.art / "runtime.json").read_text())["devices"]["ort:cpu"]
    costs, k = Costs.from_json(entry["costs"]), len(entry["costs"]["verify_ms"][0])
    h = args.host * costs.step[0]
    costs = Costs(costs.rows, [s + h for s in costs.step], [[v + h for v in vs] for vs in costs.verify],
                  costs.draft, costs.context)
    for dearer in (1.0, 1.2):
        charge = Costs(costs.rows, costs.step, [[v * dearer for v in vs] for vs in costs.verify],
                       [d * dearer for d in costs.draft], costs.context)
        for name, recs in traces.items():
            rate = {}
            for mode in ("auto", "always", "never"):
                runs = [replay(r, mode, costs, charge, k) for r in recs]
                rate[mode] = sum(n for n, _ in runs) / sum(s for _, s in runs)
            print(f"drafted rounds x{dearer}: {name}: auto/always {rate['auto'] / rate['always']:.3f}, "
                  f"auto/never {rate['auto'] / rate['never']:.3f}, always/never {rate['always'] / rate['never']:.3f}")


if __name__ == "__main__":
    main()
