"""What a reduced draft vocabulary costs in acceptance: tau on the shipped demo pair.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/draft_vocab_tau.py --work /tmp/dv-tau --n 1024 512

The demo pair (vocab 4096) is exported with its full draft vocabulary and with N tokens
chosen two ways: the fallback (lowest ids) and token counts from the first half of the
shipped held-out prompts (text, tokenized by the target's tokenizer). Every export is
decoded on the other half of the prompts (speculative and plain, one backend each, the
same run): tau, draft ms, and whether the output equals plain decoding (it must).
Prints one JSON object.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import machine, parser

from dflash_export.demo import __file__ as demo_init

DEMO = Path(demo_init).parent


def main() -> None:
    ap = parser(__doc__, json_flag=False)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-dv-tau"))
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 512])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()

    from tokenizers import Tokenizer

    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.measure import run_bench
    from dflash_export.runtime.ort.backend import OrtBackend

    a.work.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (DEMO / "prompts.jsonl").read_text().splitlines() if line.strip()]
    half = len(rows) // 2
    data = a.work / "counts.jsonl"  # the first half: where the token counts come from
    data.write_text("".join(json.dumps({"text": r["prompt"]}) + "\n" for r in rows[:half]))
    tok = Tokenizer.from_file(str(DEMO / "pair" / "target" / "tokenizer.json"))
    prompts = [tok.encode(r["prompt"]).ids[-256:] for r in rows[half:]]  # the other half: measured

    variants = {"full": {}}
    for n in a.n:
        variants[f"N{n}-fallback"] = {"draft_vocab": n}
        variants[f"N{n}-data"] = {"draft_vocab": n, "draft_vocab_data": [data]}
    out = {"machine": machine(), "pair": "demo/pair", "counts_from": f"{half} held-out prompts", "measured_on": f"{len(prompts)} others",
           "max_new_tokens": a.max_new_tokens, "variants": {}}
    for name, kw in variants.items():
        art = a.work / name
        m = export_artifact(DEMO / "pair" / "target", DEMO / "pair" / "draft", art, max_context=1024, force=True,
                            progress=False, **kw)
        r = run_bench(OrtBackend(art, threads=1), prompts, a.max_new_tokens, warmup=1)
        out["variants"][name] = {"tau": round(r["tau"], 3), "draft_ms": round(r["ms_per_call"]["draft"], 3),
                                 "step_ms": round(r["ms_per_call"]["step"], 3), "lossless": r["lossless"],
                                 "source": (m.draft_vocab or {}).get("source", "full vocabulary"),
                                 "data_coverage": (m.draft_vocab or {}).get("data_coverage")}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
