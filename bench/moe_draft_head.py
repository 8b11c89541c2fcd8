"""What a draft call whose LM head scores only the drafts a verify uses changes for `auto` on a MoE target.

    OMP_WAIT_POLICY=PASSIVE nice -n 5 python bench/moe_draft_head.py --policy POLICY.json --work WORK

POLICY.json: bench/moe_policy.py's output (its last line: the report, with the costs it measured
on the Qwen3-30B-A3B-shaped target: a plain step, a verify of each length, a draft, a context
update). WORK: where a pair with that target's head shape is made and exported once (kept for
later runs): a 2-layer dense Qwen3 target of hidden 2048 and vocabulary 151936 (the experts
do not touch the draft call) and the 1-layer drafter bench/moe_export.py makes. The draft
call's cost is the drafter's and the head's alone, so this is the real draft_block graph:

1. Live: draft_block's ms with its head over n = 1..K-1 drafts (contract.DRAFT_INDEX; ONNX
   Runtime, the policy run's threads, spinning off), every n interleaved, medians.
2. Replayed: the policy's profiles (bench/moe_policy.py: accepts nothing, the demo histogram,
   the demo recorded rounds; one controller over the requests) against the policy's costs with
   the draft call as exported before (every draft position scored, the policy's draft ms at
   every length) and as the runtime now prices it (Costs.draft_one: the policy's draft ms times
   the live ratio draft(1) / draft(K-1); a round verifying s positions pays its s - 1 drafts),
   the controller choosing its lengths from each.
Acceptance is replayed (the MoE export's drafter is random); the draft costs are measured.
Prints one JSON object. Not part of the test suite (minutes, ~6 GB of disk and memory).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from common import uptime
from moe_policy import profiles, replay

from dflash_export.runtime.controller import Controller, Costs
from dflash_export.runtime.ort.backend import OrtBackend

SHAPE = dict(vocab=151936, hidden=2048, heads=32, kv_heads=4, head_dim=128)  # Qwen3-30B-A3B's config.json


def make_pair(work: Path) -> Path:
    """The head-shaped pair, exported (once: an existing export is reused)."""
    out = work / "out"
    if (out / "manifest.json").is_file():
        return out
    from dflash_export.export.artifact import export_artifact
    from dflash_export.models import TargetConfig, new_drafter
    from dflash_export.models.tiny import make_target

    make_target(work / "target", "qwen3", vocab=SHAPE["vocab"], hidden=SHAPE["hidden"], layers=2, heads=SHAPE["heads"],
                kv_heads=SHAPE["kv_heads"], head_dim=SHAPE["head_dim"], intermediate=256, tie=False, std=0.02)
    tc = TargetConfig.load(work / "target")
    new_drafter(tc, num_layers=1, block_size=16, mask_token_id=SHAPE["vocab"] - 2, target_layer_ids=[1],
                intermediate_size=2 * SHAPE["hidden"]).save_pretrained(work / "draft")  # as bench/moe_export.py's
    export_artifact(work / "target", work / "draft", out, max_context=512, progress=False)
    return out


def draft_ms_by_scored(be: OrtBackend, repeats: int) -> list[float]:
    """Median ms of draft_block with its head over n = 1..K-1 drafts, after a 64-token context."""
    k = be.manifest.block_size
    be.target(np.arange(5, 69, dtype=np.int64))
    be.commit(64)
    be.draft_context(64)
    ts: dict[int, list[float]] = {n: [] for n in range(1, k)}
    for r in range(repeats + 1):  # the first pass warms each shape up
        for n in range(1, k):
            t = time.perf_counter()
            d = be.draft_block(5, n)
            if r:
                ts[n].append(time.perf_counter() - t)
            assert len(d.ids) == n, "the export's draft_block has no draft_index: re-export WORK"
    return [1e3 * float(np.median(ts[n])) for n in range(1, k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    pol = json.loads(args.policy.read_text().strip().splitlines()[-1])
    c, k, threads = pol["costs_ms"], pol["target"]["block"], pol["threads"]
    assert pol["target"]["vocab"] == SHAPE["vocab"], "the policy's target is not Qwen3-30B-A3B-shaped"
    report = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_before": uptime(),
              "policy": str(args.policy), "policy_date": pol["date"], "threads": threads}
    be = OrtBackend(make_pair(args.work), threads=threads, spin=False)
    assert be.manifest.block_size == k
    live = draft_ms_by_scored(be, args.repeats)
    report["live_draft_block_ms_by_scored_drafts"] = [round(x, 2) for x in live]
    report["live_draft_block_ms_by_verify_length"] = {s: round(live[s - 2], 2) for s in (2, 4, 8, k)}
    as_is = Costs([1], [c["step"]], [c["verify_by_length"]], [c["draft"]], [c["context"]], "calibrated")
    sliced = Costs([1], [c["step"]], [c["verify_by_length"]], [c["draft"]], [c["context"]], "calibrated",
                   draft_one=[c["draft"] * live[0] / live[-1]])
    report["policy_draft_ms_priced_by_verify_length"] = {s: round(sliced.draft_ms(1, s), 1) for s in (2, 4, 8, k)}
    streams = {"accepts nothing (8 requests)": [lambda t: 1] * 8, **profiles(128, 24)}
    out = {}
    for name, reqs in streams.items():
        row = {}
        for label, costs in (("draft as exported before (every position scored)", as_is),
                             ("head over the drafts used (draft_index)", sliced)):
            res = {}
            for mode in ("auto", "never"):
                ctl = Controller(costs, k)
                res[mode] = [replay(a, 128, mode, costs, k, ctl) for a in reqs]
            rate = {mode: sum(x[0] for x in v) / sum(x[1] for x in v) for mode, v in res.items()}
            row[label] = {"auto_over_plain": round(rate["auto"] / rate["never"], 3),
                          "mean_verify_len": round(float(np.mean([x[2] for x in res["auto"] if x[2]] or [0])), 1)}
        out[name] = row
    report["replayed"] = out
    report["load_after"] = uptime()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
