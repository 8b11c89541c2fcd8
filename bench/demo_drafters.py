"""Two drafters of the demo target on the held-out prompts, interleaved: tau and speedup over plain decoding.

    nice -n 10 .venv/bin/python bench/demo_drafters.py OLD_ART NEW_ART [--threads 1] [--passes 3]

OLD_ART and NEW_ART are exports of the demo target with each drafter (`dflash-export demo
--pair DIR --out OUT` exports to OUT/artifact, or `export_artifact` as the demo calls it).
Each pass decodes the 24 held-out prompts (demo/prompts.jsonl, 128 new tokens, greedy) with
both, prompt by prompt in turn, drafting every round with the whole block verified (the
drafter's own acceptance: tau) and plainly (runtime/measure.py measure_many), so a change in
the machine's load hits both alike. Prints per drafter: tau, mean verify length, and the
speedup over plain decoding of each pass and their median, with the load average. One JSON
object; the tokens must equal plain decoding's (lossless) for both.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from tokenizers import Tokenizer

from common import ROOT, parser, report, write_report
from dflash_export.runtime.load import open_backend
from dflash_export.runtime.measure import measure_many, summarize



def main() -> None:
    ap = parser(__doc__, "demo_drafters.json", json_flag=False)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.old / "tokenizer.json"))
    texts = [json.loads(x)["prompt"] for x in (ROOT / "demo" / "prompts.jsonl").read_text().splitlines() if x.strip()]
    prompts = [tok.encode(t).ids for t in texts]
    backends = {"old": open_backend(args.old, "ort", "cpu", threads=args.threads),
                "new": open_backend(args.new, "ort", "cpu", threads=args.threads)}
    load, runs = [os.getloadavg()[0]], {label: [] for label in backends}
    for i in range(args.passes):
        for label, (spec, base) in measure_many(backends, prompts, args.max_new_tokens, warmup=1 if i == 0 else 0).items():
            runs[label].append(summarize(spec, base, 16))
        load.append(os.getloadavg()[0])
    out = report(threads=args.threads, prompts=len(prompts), load_1min=[round(x, 1) for x in load])
    for label, rs in runs.items():
        out[label] = {"tau": round(rs[0]["tau"], 3), "mean_verify_len": round(rs[0]["mean_verify_len"], 2),
                      "speedup": [round(r["speedup"], 3) for r in rs],
                      "speedup_median": round(statistics.median(r["speedup"] for r in rs), 3),
                      "lossless": all(r["lossless"] for r in rs)}
    out["new_over_old_speedup"] = [round(n["speedup"] / o["speedup"], 3) for n, o in zip(runs["new"], runs["old"])]
    print(json.dumps({k: v for k, v in out.items() if k not in ("machine", "load_before")}, indent=1))
    write_report(out, args.out)


if __name__ == "__main__":
    main()
