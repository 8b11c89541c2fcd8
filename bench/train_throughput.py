"""Drafter training throughput on the shipped demo target, against this machine's GEMM rate.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/train_throughput.py --rounds 4

Tokens/s = supervised draft positions per second at the demo's training shape (batch 8,
anchors 48, block 16, sequences of 416 tokens with the greedy part from 160). One step =
forward + backward + AdamW. Variants, interleaved round by round in one run:
- `pre-issue`: the training step as it was before (models/train.py at PRE_COMMIT, loaded
  from git): the target runs every step, each block gathers its context; fp32 and bf16.
- `now`: the current step as `train-draft` runs it (the target's features captured while it
  generated, the fused head + loss of train/loss.py); fp32 and bf16.
FLOPs per step: `train.speed.step_flops` (drafter forward + backward and the LM head over the
supervised positions; the target excluded); the GEMM rate is fp32 (and bf16) at the LM-head
shape (5760 x H x V; fp32 inside every round, the median taken like the variants') and at
2048^3. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRE_COMMIT = "3647842"  # main before the training-speed work


def load_pre_issue():
    """The pre-issue training module, executed from git as part of dflash_export.models (where it lived),
    its old sibling modules aliased to where they live now."""
    import dflash_export.models
    import dflash_export.train.data
    import dflash_export.train.state

    sys.modules.setdefault("dflash_export.models.train_data", dflash_export.train.data)
    sys.modules.setdefault("dflash_export.models.train_state", dflash_export.train.state)
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{PRE_COMMIT}:models/train.py"], capture_output=True,
                         text=True, check=True).stdout
    mod = types.ModuleType("dflash_export.models._train_pre_issue")
    mod.__package__ = "dflash_export.models"
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, "pre-issue models/train.py", "exec"), mod.__dict__)
    return mod


def gemm_rate(m: int, k: int, n: int, dtype, reps: int = 5) -> float:
    """GFLOP/s of one [m, k] x [k, n] matmul, the best of `reps` after a warm-up."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    ap.add_argument("--variants", nargs="+", default=["pre-issue fp32", "now fp32", "pre-issue bf16", "now bf16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()

    from dflash_export.demo import __file__ as demo_init
    from dflash_export.models import Target, TargetConfig, new_drafter
    from dflash_export.train import train as T
    from dflash_export.train.data import Shard
    from dflash_export.train.speed import step_flops

    tdir = Path(demo_init).parent / "pair" / "target"
    tc = TargetConfig.load(tdir)
    taps_ids, k, batch, anchors, length, start = [1, 2, 3, 4], 16, 8, 48, 416, 160
    target = Target.from_pretrained(tdir, tap_ids=taps_ids).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, tc.vocab_size, (batch, length), generator=g)
    lens = torch.full((batch,), length)
    shard = Shard(tokens, start, lens)
    pos = torch.arange(length)[None].expand(batch, length)
    with torch.no_grad():
        taps = target(tokens, pos, target.empty_kv(batch))[1].to(torch.bfloat16)  # what FeatureCache keeps
    w = T.loss_weights(k, 7.0)
    pre = load_pre_issue() if any(v.startswith("pre-issue") for v in a.variants) else None

    def make(variant: str):
        torch.manual_seed(0)
        d = new_drafter(tc, num_layers=1, block_size=k, target_layer_ids=taps_ids, mask_token_id=1).train()
        opt = torch.optim.AdamW(d.parameters(), lr=1e-4)
        bf16 = variant.endswith("bf16")

        def step() -> int:
            si, an = T.sample_anchors(shard, torch.arange(batch), anchors, g)
            if variant.startswith("pre-issue"):
                loss, _, valid = pre.draft_step(target, d, tokens, lens, si, an, k, 1, w, autocast=bf16)
            else:
                loss, _, valid = T.draft_step(target, d, tokens, lens, si, an, k, 1, w, bf16, taps, correct=False)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return int(valid.sum())
        return step

    steps = {v: make(v) for v in a.variants}
    for fn in steps.values():
        fn()  # warm-up
    rows = batch * anchors * (k - 1)
    rates: dict[str, list[float]] = {v: [] for v in a.variants}
    gemm: list[float] = []  # the fp32 LM-head GEMM rate, measured inside every round like the variants
    for _ in range(a.rounds):
        for v, fn in steps.items():
            t, n = time.perf_counter(), 0
            for _ in range(a.steps):
                n += fn()
            rates[v].append(n / (time.perf_counter() - t))
        gemm.append(gemm_rate(rows, tc.hidden_size, tc.vocab_size, torch.float32, reps=2))
    flops = step_flops(batch, length, batch * anchors, k, tc.hidden_size, tc.vocab_size, len(taps_ids), 1,
                       tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.intermediate_size,
                       mean_keys=(start + length) / 2 + k)
    g32 = statistics.median(gemm)  # the same statistic as the variants' rates, over the same rounds
    g16 = gemm_rate(rows, tc.hidden_size, tc.vocab_size, torch.bfloat16)
    res = {
        "load_before": load_before, "threads": a.threads, "torch": torch.__version__,
        "shape": {"batch": batch, "anchors": anchors, "block": k, "seq_len": length, "greedy_from": start},
        "flops_per_step": flops, "flops_per_supervised_position": flops / rows,
        "gemm_gflops": {"lm_head_fp32": round(g32, 1), "lm_head_fp32_all": [round(x, 1) for x in gemm],
                        "lm_head_bf16": round(g16, 1),
                        "2048^3_fp32": round(gemm_rate(2048, 2048, 2048, torch.float32), 1)},
        "tokens_per_s": {v: round(statistics.median(r)) for v, r in rates.items()},
        "tokens_per_s_all": {v: [round(x) for x in r] for v, r in rates.items()},
    }
    res["gflops_achieved"] = {v: round(t / rows * flops / 1e9, 1) for v, t in res["tokens_per_s"].items()}
    res["fraction_of_lm_head_fp32_gemm"] = {v: round(x / g32, 3) for v, x in res["gflops_achieved"].items()}
    if "pre-issue fp32" in rates and "now fp32" in rates:
        res["now_fp32_over_pre_issue_fp32"] = round(res["tokens_per_s"]["now fp32"] / res["tokens_per_s"]["pre-issue fp32"], 2)
    best = max(res["tokens_per_s"], key=res["tokens_per_s"].get)
    res["best_now_over_pre_issue_fp32"] = (best, round(res["tokens_per_s"][best] / res["tokens_per_s"].get("pre-issue fp32", float("nan")), 2))
    res["load_after"] = os.getloadavg()
    json.dump(res, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
