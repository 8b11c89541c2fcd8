"""The ort flavour's int8 K/V cache (export --kv-cache int8) against its fp32 cache: speed of
a batched decoding step at long context, and what it costs in accuracy.

    .venv/bin/python bench/kv_cache.py --work /tmp/kv8 [--layers 8] [--threads 1] [--clock cpu] [--repeats 12]

speed: Qwen3-0.6B's shape (hidden 1024, 16 q / 8 kv heads of 128, vocab 151936, tied) with
random weights at --layers of its 28 layers, exported twice with --attention ort (fp32 cache,
int8 cache), both quantized to int4 (MatMulNBits, accuracy level 4, as bench/batch.py's
int4-ort); made once in --work (8 layers: ~3 minutes on 2 cores). Then, interleaved, plain
decoding steps with every row at --context positions (bench/batch.py's `fill`), 1 row and 4
rows, fastest of --repeats: the step, and the aggregate ratio 4 x (1-row step) / (4-row step).
--clock cpu (process time) is the sound measure with 1 thread on a shared machine.

accuracy: the trained demo target (demo/pair/target), its int8 scales calibrated as `export`
calibrates them (export/kv_calibrate.py: its seed prompts), then on other prompts (text the
target generates from them, --eval-tokens) the target's logits at every position with the
int8 cache against the fp32 cache: KL(fp32 || int8), top-1 agreement; and the share of cache
values the scales clamp, and the largest |value| / (127 x scale) seen; for each of --margins. Computed with the
PyTorch reference of the exported graph (export/graphs.py TargetOrtGraph, export/gqa.py's
quantization), which `check` holds to ONNX Runtime's output within 1e-4 (tests/test_kv_int8.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
EVAL_PROMPTS = ("In the morning the market", "import numpy as np\n", "The three largest rivers are", "Dear friend,",
                "A recipe for bread:", "The theorem states that")


def exports(work: Path, layers: int) -> dict[str, Path]:
    """{"fp32": int4 weights + fp32 cache, "int8": int4 weights + int8 cache}, made once."""
    from common import make_checkpoint

    from dflash_export.export.artifact import export_artifact
    from dflash_export.export.quantize import QuantOptions, quantize_artifact

    if not (work / "target" / "config.json").is_file():
        make_checkpoint(work, 151936, 1024, layers, 3072, heads=16, kv_heads=8, tie=True)
    outs = {}
    for cache, kv in (("fp32", None), ("int8", "int8")):
        out = outs[cache] = work / f"out-int4-ort-{cache}"
        if not (out / "manifest.json").is_file():
            t0 = time.perf_counter()
            base = work / f"out-ort-{cache}"
            export_artifact(work / "target", work / "draft", base, max_context=1280, attention="ort", kv_cache=kv,
                            force=True, progress=False)
            quantize_artifact(base, out, QuantOptions(scheme="int4", draft=True, lm_head=True, accuracy_level=4),
                              force=True, progress=False)
            print(json.dumps({"made": out.name, "seconds": round(time.perf_counter() - t0)}), flush=True)
    return outs


def speed(outs: dict[str, Path], threads: int, clock_name: str, repeats: int, context: int) -> dict:
    from batch import fill

    from dflash_export.runtime.ort.backend import OrtBackend

    bes = {(cache, b): OrtBackend(d, threads=threads, max_batch=b, drafter=False) for cache, d in outs.items() for b in (4, 1)}
    for be in bes.values():
        fill(be, be.max_batch, context)
        for buf in be.kv:  # int8 buffers: fill's 0.01 rounds to 0; any value writes every page
            if buf is not None and buf.dtype == np.int8:
                buf.fill(3)
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    ms: dict = {k: [] for k in bes}
    for i in range(repeats + 1):
        for (cache, b), be in bes.items():
            be.lengths[:b] = context
            t = clock()
            be.target_rows(list(range(b)), np.ones((b, 1), np.int64), np.ones(b, np.int64), None)
            be.commit_rows(list(range(b)), [1] * b)
            if i:  # the first pass warms up
                ms[cache, b].append(1e3 * (clock() - t))
    best = {k: min(v) for k, v in ms.items()}
    return {"context": context, "step_ms": {f"{c}_rows_{b}": round(v, 2) for (c, b), v in best.items()},
            "tokens_per_s": {f"{c}_rows_{b}": round(1e3 * b / v, 1) for (c, b), v in best.items()},
            "aggregate_ratio_4_vs_1": {c: round(4 * best[c, 1] / best[c, 4], 3) for c in outs},
            "int8_vs_fp32_rows_4": round(best["fp32", 4] / best["int8", 4], 3),
            "int8_vs_fp32_rows_1": round(best["fp32", 1] / best["int8", 1], 3)}


def accuracy(eval_tokens: int, margins: list[float]) -> dict:
    import torch
    from tokenizers import Tokenizer

    from dflash_export.export import graphs, kv_calibrate
    from dflash_export.models import Target

    t_dir = ROOT / "demo" / "pair" / "target"
    target = Target.from_pretrained(t_dir, [], torch.float32)
    tok = Tokenizer.from_file(str(t_dir / "tokenizer.json"))
    ctx = 2048
    prompts, source = kv_calibrate.seed_prompts(t_dir, target.config.vocab_size, None)
    fp = graphs.TargetOrtGraph(target, ctx)
    a = target.model.layers[0].self_attn

    def logits(graph, ids, int8: bool):
        L = len(ids)
        cache = [torch.zeros(1, a.hkv, L, a.d, dtype=torch.int8 if int8 else torch.float32)
                 for _ in range(2 * len(target.model.layers))]
        out = graph.run(torch.tensor([ids]), torch.arange(L)[None], torch.tensor([L - 1], dtype=torch.int32),
                        torch.tensor(L, dtype=torch.int32), None, cache)
        return out[0][0].double(), out[3:]

    texts = []
    with torch.no_grad():
        for text in EVAL_PROMPTS:  # the text the fp32-cache target generates greedily
            ids = tok.encode(text).ids
            for _ in range(eval_tokens):
                ids.append(int(logits(fp, ids, False)[0][-1].argmax()))
            texts.append((ids, *logits(fp, ids, False)))
    rows = {}
    for margin in margins:
        scales = kv_calibrate.calibrate(fp, prompts, ctx, margin=margin)
        q8 = graphs.TargetOrtGraph(target, ctx, scales)
        kls, agree, n, clamped, values, worst = [], 0, 0, 0, 0, 0.0
        with torch.no_grad():
            for ids, ref, kv in texts:
                got = logits(q8, ids, True)[0]  # one call: every position's logits
                p, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
                kls.append((p.exp() * (p - lq)).sum(-1))
                agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
                n += len(ids)
                for c, sc in zip(kv, (x for pair in scales for x in pair)):  # how far past the calibrated scales
                    steps = c[0].abs() / sc
                    clamped += int((steps > 127.5).sum())
                    values += steps.numel()
                    worst = max(worst, float(steps.max()) / 127)
        kl = torch.cat(kls)
        rows[str(margin)] = {"kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)), "kl_max": float(kl.max()),
                             "top1_agreement": round(agree / n, 4), "clamped_fraction": clamped / values,
                             "largest_over_calibrated_range": round(worst, 3)}
    return {"target": "demo/pair/target", "calibration": source, "eval_prompts": len(EVAL_PROMPTS),
            "positions": sum(len(t[0]) for t in texts), "by_margin": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8, help="of Qwen3-0.6B's 28 (the cache per layer is the same)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--eval-tokens", type=int, default=200)
    ap.add_argument("--margins", default="1.25,2", help="calibration margins compared (the export's: export/kv_calibrate.py MARGIN, 2)")
    ap.add_argument("--skip", choices=("speed", "accuracy"), default=None)
    a = ap.parse_args()
    from common import machine, uptime

    print(json.dumps({"machine": machine(),
                      "threads": a.threads, "clock": a.clock, "layers": a.layers}), flush=True)
    if a.skip != "accuracy":
        print(json.dumps({"accuracy": accuracy(a.eval_tokens, [float(x) for x in a.margins.split(",")]), "uptime": uptime()}), flush=True)
    if a.skip != "speed":
        outs = exports(a.work, a.layers)
        print(json.dumps({"speed": speed(outs, a.threads, a.clock, a.repeats, a.context), "uptime": uptime()}), flush=True)


if __name__ == "__main__":
    main()
