"""DFlash 2 drafters: what a draft costs at a realistic shape, and acceptance at T > 0.

cost: a random-weight target of Qwen3-0.6B's shape (bench/real_sizes.py's: 28 layers, hidden
1024, 16/8 heads of 128, vocab 151936, tied) and a random DFlash 2 drafter for it (hidden 1024,
--draft-layers sliding layers, block 16, selector top 16 of rank 256, kernel 2 in groups of 16,
softcap 20), exported with `--max-context 4096`, then after a --context-token prompt, interleaved
in one process: a target plain step (1 token), a 16-token verify and a draft_block call (median
of --calls each). Prints one JSON object. Minutes and ~5 GB of RAM; the weights are random, so
only the per-call costs mean anything.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/dflash2.py cost --work /tmp/d2cost

acceptance: tests/dflash2_trained.py's briefly trained pair (the official drafter class fitted
to the target's samples with the official forward), mean acceptance length at T = 0.8 of the
deployed loop (ONNX Runtime, batched) vs the official `dflash_generate` (the `dflash` 0.1.0
package) on the same prompts and seeds, with the standard error of the difference; the long
version of tests/test_dflash2_sampling.py's check.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/dflash2.py acceptance --seeds 512
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from common import make_checkpoint, parser, report as start_report, uptime
from real_sizes import SHAPE

ROOT = Path(__file__).resolve().parents[1]


def write_drafter(work: Path, layers: int) -> None:
    """A random DFlash 2 drafter for work/target in the released layout."""
    import torch

    from dflash_export.models import TargetConfig, draft_config_dict
    from dflash_export.models.draft_config import default_target_layer_ids
    from dflash_export.models.dflash2 import DFlash2Config, DFlash2Drafter

    tc = TargetConfig.load(work / "target")
    cfg = draft_config_dict(tc, num_layers=layers, block_size=16, mask_token_id=151669 % tc.vocab_size,
                            target_layer_ids=default_target_layer_ids(tc.num_layers, 5),
                            layer_types=["sliding_attention"] * layers, sliding_window=2048)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
                                final_logit_softcapping=20.0, output_multiplier=1.0)
    torch.manual_seed(0)
    model = DFlash2Drafter(DFlash2Config.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(work / "draft2")


def cost(a) -> dict:
    import numpy as np

    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.load import open_backend

    work, s = Path(a.work), SHAPE
    if not (work / "target" / "config.json").exists():
        make_checkpoint(work, s["vocab"], s["hidden"], s["layers"], s["inter"], heads=s["heads"],
                        kv_heads=s["kv_heads"], tie=True)
    out = work / f"out-{a.draft_layers}l"
    export_s = None
    if not (out / "manifest.json").exists():
        write_drafter(work, a.draft_layers)
        t0 = time.perf_counter()
        export_artifact(work / "target", work / "draft2", out, max_context=4096, force=True, progress=False)
        export_s = round(time.perf_counter() - t0, 1)
    be = open_backend(out, "ort", "cpu", threads=a.threads)
    ids = np.random.default_rng(0).integers(0, s["vocab"] - 2, a.context)
    for i in range(0, a.context, be.max_chunk):
        chunk = ids[i : i + be.max_chunk]
        be.target(chunk)
        be.commit(len(chunk))
        be.draft_context(len(chunk))
    block = np.full(16, 7, np.int64)
    calls = {"plain_step": lambda: be.target(block[:1]), "verify_16": lambda: be.target(block),
             "draft_block": lambda: be.draft_block(7)}
    times = {k: [] for k in calls}
    for i in range(a.calls + 3):  # interleaved; the first 3 rounds warm up
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            if i >= 3:
                times[k].append(time.perf_counter() - t0)
    ms = {k: round(1e3 * statistics.median(v), 1) for k, v in times.items()}
    return {"shape": s, "draft_layers": a.draft_layers, "context": a.context, "threads": a.threads,
            "calls": a.calls, "export_s": export_s, "median_ms": ms,
            "draft_over_step": round(ms["draft_block"] / ms["plain_step"], 2),
            "verify_over_step": round(ms["verify_16"] / ms["plain_step"], 2)}


def acceptance(a) -> dict:
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from dflash2_trained import TEMP, V, trained_export
    from dflash import model as dm

    from dflash_export.runtime.load import open_backend
    from dflash_export.runtime.loop import Request, generate_batch
    from dflash_export.runtime.sampling import Sampling
    from dflash_export.models.tiny import hf_model

    torch.set_num_threads(1)
    dm._cuda_time = time.perf_counter  # its stats time with CUDA syncs; no GPU here
    root = trained_export()
    official = dm.DFlash2DraftModel.from_pretrained(str(root / "d"), dtype=torch.float32).eval()
    hf = hf_model(root / "t")
    be = open_backend(root / "out", "ort", "cpu", max_batch=32)
    prompts = [np.random.default_rng(10**6 + s).integers(0, V, 3 + s % 5).tolist() for s in range(a.seeds)]
    gens, _ = generate_batch(be, [Request(p, a.new, Sampling(TEMP, seed=s), stop_token_ids=())
                                  for s, p in enumerate(prompts)], batch=32)
    ours = [x for g in gens for x in g.acceptance_lengths]
    ref = []
    for s, p in enumerate(prompts):
        torch.manual_seed(s)
        ref += dm.dflash_generate(official, hf, torch.tensor([p]), a.new, None, temperature=TEMP,
                                  return_stats=True).acceptance_lengths
    se = float(np.hypot(np.std(ours) / np.sqrt(len(ours)), np.std(ref) / np.sqrt(len(ref))))
    return {"temperature": TEMP, "seeds": a.seeds, "new_tokens": a.new,
            "ours": {"mean": round(float(np.mean(ours)), 4), "rounds": len(ours)},
            "official": {"mean": round(float(np.mean(ref)), 4), "rounds": len(ref)},
            "ratio": round(float(np.mean(ours) / np.mean(ref)), 4), "se_of_difference": round(se, 4)}


def main() -> None:
    ap = parser(__doc__, json_flag=False)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--work", required=True)
    c.add_argument("--draft-layers", type=int, default=3)
    c.add_argument("--context", type=int, default=512)
    c.add_argument("--calls", type=int, default=20)
    c.add_argument("--threads", type=int, default=1)
    r = sub.add_parser("acceptance")
    r.add_argument("--seeds", type=int, default=512)
    r.add_argument("--new", type=int, default=48)
    a = ap.parse_args()
    report = start_report()
    report.update(cost(a) if a.what == "cost" else acceptance(a))
    report["load_after"] = uptime()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
