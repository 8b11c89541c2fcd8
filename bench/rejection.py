"""Acceptance at temperature > 0 on the shipped demo pair: rejection sampling vs the official
reference's rejection sampling vs sample-and-compare, same prompts, many seeds.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/rejection.py --work /tmp/rej --seeds 8 --new 64

- runtime, rejection: `generate(..., sampling=Sampling(T, method="rejection"))` on the ONNX Runtime backend over
  the demo pair exported with this checkout (the default at T > 0).
- runtime, compare: the same with `method="compare"` (argmax drafts vs a target sample).
- reference: the official z-lab `dflash_generate` (the `dflash` 0.1.0 package, installed with
  --no-deps by make setup) over transformers' Qwen3 target and its `DFlashDraftModel`, the
  same checkpoints, seeded with torch.manual_seed.
Acceptance length per round = tokens the round emitted (anchor's accepted drafts + 1), as
both loops count it; no stop tokens, so every request runs its full budget. Sanity first:
at T = 0 the reference and the runtime give the same tokens on the first prompts.
Prints one JSON object: mean acceptance (and its standard error over requests) per method,
the ratios, the settings and the load.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from common import ROOT, machine, parser


def reference(target_dir: Path, draft_dir: Path):
    import torch
    import transformers
    from dflash import model as ref

    ref._cuda_time = time.perf_counter  # the reference times with torch.cuda.synchronize; CPU here
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = ref.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()

    def run(prompt: list[int], new: int, temperature: float, seed: int):
        torch.manual_seed(seed)
        out = ref.dflash_generate(drafter, target, torch.tensor([prompt]), new, None, temperature=temperature,
                                  return_stats=True)
        return out.output_ids[0, len(prompt):].tolist(), list(out.acceptance_lengths)

    return run


def main() -> None:
    ap = parser(__doc__, json_flag=False)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--prompts", type=int, default=24, help="the first N held-out demo prompts")
    a = ap.parse_args()

    import torch

    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.runtime.sampling import Sampling
    from dflash_export.serve.text import load_tokenizer

    torch.set_num_threads(1)
    start = machine()
    pair = ROOT / "demo/pair"
    out = a.work / "demo-out"
    a.work.mkdir(parents=True, exist_ok=True)
    if not (out / "manifest.json").is_file():
        export_artifact(pair / "target", pair / "draft", out, force=True, progress=False)
    tok = load_tokenizer(out)
    lines = [x for x in (ROOT / "demo/prompts.jsonl").read_text().splitlines() if x.strip()][: a.prompts]
    prompts = [tok.encode(json.loads(x)["prompt"]).ids for x in lines]
    be = OrtBackend(out, threads=1)
    ref_run = reference(pair / "target", pair / "draft")

    for p in prompts[:3]:  # the two loops agree at T = 0 before anything is compared at T > 0
        ours = generate(be, p, 32, stop_token_ids=()).tokens
        theirs = ref_run(p, 32, 0.0, 0)[0]
        assert ours == theirs, "greedy tokens differ from the reference's; nothing below would mean anything"

    taus = {"runtime_rejection": [], "runtime_compare": [], "reference_rejection": []}
    t0 = time.time()
    for seed in range(a.seeds):
        for i, p in enumerate(prompts):
            s = 1000 * seed + i
            for mode in ("rejection", "compare"):
                g = generate(be, p, a.new, sampling=Sampling(a.temperature, seed=s, method=mode), stop_token_ids=())
                taus[f"runtime_{mode}"].append(g.acceptance_lengths)
            taus["reference_rejection"].append(ref_run(p, a.new, a.temperature, s)[1])

    def stats(runs):
        per = np.array([np.mean(r) for r in runs])
        allr = np.concatenate([np.asarray(r, float) for r in runs])
        return {"mean_acceptance": round(float(allr.mean()), 3), "stderr_over_requests": round(float(per.std() / np.sqrt(len(per))), 3),
                "rounds": int(len(allr))}

    res = {k: stats(v) for k, v in taus.items()}
    ref_tau = res["reference_rejection"]["mean_acceptance"]
    print(json.dumps({
        "pair": "demo", "temperature": a.temperature, "seeds": a.seeds, "prompts": len(prompts), "new_tokens": a.new,
        **res,
        "runtime_rejection_vs_reference": round(res["runtime_rejection"]["mean_acceptance"] / ref_tau, 3),
        "runtime_compare_vs_reference": round(res["runtime_compare"]["mean_acceptance"] / ref_tau, 3),
        "wall_s": round(time.time() - t0, 1), "machine": start,
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }, indent=1))


if __name__ == "__main__":
    main()
