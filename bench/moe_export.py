"""Peak memory of exporting a Qwen3-30B-A3B-shaped MoE target, whose experts are streamed.

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python bench/moe_export.py --work /tmp/moe-export --layers 2

Qwen3-30B-A3B's layer shape with real widths (hidden 2048, 32 query / 4 KV heads of 128,
128 experts of width 768, 8 per token, vocab 151936) at reduced depth, random bf16 weights
written the way the released checkpoint is (one safetensors shard per layer, per-expert keys;
`--layout fused`: transformers 5.x's gate_up_proj / down_proj), plus a 1-layer drafter. Then,
each in a process of its own so its peak RSS is its own: `export_artifact` per dtype (and
path), its peak RSS (VmHWM) against the artifact it wrote and against the fp32 size of the
weights it exports. Prints one JSON object. Not part of the test suite (minutes, GBs of disk).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from common import peak_rss_bytes, run_child, uptime

SHAPE = dict(vocab=151936, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, width=768,
             dense=6144)  # Qwen3-30B-A3B's config.json


def make_target(t: Path, layers: int, fused: bool) -> None:
    """Random bf16 checkpoint at Qwen3-30B-A3B's shape, one shard per layer (small writer RSS)."""
    import torch
    from safetensors.torch import save_file

    s = SHAPE
    h, hd, w, e = s["hidden"], s["head_dim"], s["width"], s["experts"]
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": s["vocab"],
           "hidden_size": h, "intermediate_size": s["dense"], "moe_intermediate_size": w, "num_experts": e,
           "num_experts_per_tok": s["top_k"], "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "num_hidden_layers": layers, "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
           "head_dim": hd, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
           "tie_word_embeddings": False, "eos_token_id": s["vocab"] - 1, "bos_token_id": 0, "dtype": "bfloat16"}
    t.mkdir(parents=True)
    (t / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(t / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(s["vocab"], h)})
    shard("head.safetensors", {"lm_head.weight": rand(s["vocab"], h), "model.norm.weight": ones(h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {p + "self_attn.q_proj.weight": rand(s["heads"] * hd, h),
                 p + "self_attn.k_proj.weight": rand(s["kv_heads"] * hd, h),
                 p + "self_attn.v_proj.weight": rand(s["kv_heads"] * hd, h),
                 p + "self_attn.o_proj.weight": rand(h, s["heads"] * hd),
                 p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                 p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                 p + "mlp.gate.weight": rand(e, h)}
        if fused:
            layer[p + "mlp.experts.gate_up_proj"] = rand(e, 2 * w, h)
            layer[p + "mlp.experts.down_proj"] = rand(e, h, w)
        else:
            for x in range(e):
                q = f"{p}mlp.experts.{x}."
                layer |= {q + "gate_proj.weight": rand(w, h), q + "up_proj.weight": rand(w, h),
                          q + "down_proj.weight": rand(h, w)}
        shard(f"layer{i}.safetensors", layer)
        del layer
    (t / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def make_drafter(t: Path, d: Path, layers: int) -> None:
    from dflash_export.models import TargetConfig, new_drafter

    tc = TargetConfig.load(t)
    new_drafter(tc, num_layers=1, block_size=16, mask_token_id=SHAPE["vocab"] - 2, target_layer_ids=[layers - 1],
                intermediate_size=2 * SHAPE["hidden"]).save_pretrained(d)


def do_make(work: Path, layers: int, fused: bool) -> dict:
    t0 = time.perf_counter()
    make_target(work / "target", layers, fused)
    make_drafter(work / "target", work / "draft", layers)
    return {"make_s": round(time.perf_counter() - t0, 1), "make_peak_rss": peak_rss_bytes()}


def do_export(work: Path, dtype: str, moe: str, whole: bool, quantize: str | None = None) -> dict:
    from dflash_export.export.artifact import checkpoint_elements, export_artifact
    from dflash_export.export.quantize import QuantOptions

    if whole:  # the comparison: experts loaded with the rest of the checkpoint, as before streaming
        import contextlib

        from dflash_export.models import checkpoint
        checkpoint.experts_on_meta = contextlib.nullcontext
    out = work / f"out-{dtype}-{moe}"
    t0 = time.perf_counter()
    export_artifact(work / "target", work / "draft", out, dtype=dtype, moe=moe, max_context=1024, force=True,
                    progress=True, quantize=QuantOptions(quantize) if quantize else None)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    artifact = sum(f.stat().st_size for f in out.iterdir())
    fp32 = 4 * (checkpoint_elements(work / "target") + checkpoint_elements(work / "draft"))
    shutil.rmtree(out)  # room for the next one
    return {"dtype": dtype, "moe": moe, "quantize": quantize, "experts": "whole" if whole else "streamed", "export_s": round(seconds, 1), "peak_rss": peak, "artifact_bytes": artifact,
            "fp32_weight_bytes": fp32, "peak_over_artifact": round(peak / artifact, 3),
            "peak_over_fp32_weights": round(peak / fp32, 3)}


def do_quantize(src: Path, scheme: str) -> dict:
    """`quantize SRC --quantize SCHEME` of a float export, in this process: its peak RSS against what it wrote."""
    from dflash_export.export.quantize import QuantOptions, quantize_artifact

    out = src.parent / f"{src.name}-{scheme}"
    t0 = time.perf_counter()
    quantize_artifact(src, out, QuantOptions(scheme), force=True, progress=True)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    artifact = sum(f.stat().st_size for f in out.iterdir())
    float_bytes = sum(f.stat().st_size for f in src.iterdir())
    shutil.rmtree(out)
    return {"quantize": scheme, "src": str(src), "quantize_s": round(seconds, 1), "peak_rss": peak,
            "artifact_bytes": artifact, "float_artifact_bytes": float_bytes, "peak_over_artifact": round(peak / artifact, 3)}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    ram = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return f"{cpu}, {os.cpu_count()} CPUs, {ram:.0f} GiB RAM"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-moe-export"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--layout", choices=("per-expert", "fused"), default="per-expert")
    ap.add_argument("--runs", default="fp32:op,fp16:standard,fp16:standard:whole",
                    help="dtype:moe[:whole|:int4|:int8] exports, comma-separated (whole: experts loaded, not "
                         "streamed; int4 / int8: export --quantize, the float export then its quantization, one process)")
    ap.add_argument("--step", choices=("make", "export", "quantize"))
    ap.add_argument("--src", type=Path, help="--step quantize: the float export to quantize")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--moe", default="op")
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--quantize", choices=("int4", "int8"))
    args = ap.parse_args()
    if args.step == "make":
        print(json.dumps(do_make(args.work, args.layers, args.layout == "fused")))
        return
    if args.step == "quantize":
        print(json.dumps(do_quantize(args.src, args.quantize or "int4")))
        return
    if args.step == "export":
        print(json.dumps(do_export(args.work, args.dtype, args.moe, args.whole, args.quantize)))
        return
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    common = ["--work", str(args.work), "--layers", str(args.layers), "--layout", args.layout]
    report = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
              "layers": args.layers, "layout": args.layout, "shape": SHAPE, "load_before": uptime()}
    report["make"] = run_child(__file__, [*common, "--step", "make"])
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in (args.work / "target").iterdir())
    report["exports"] = []
    for run in args.runs.split(","):
        dtype, moe, *extra = run.split(":")
        report["exports"].append(run_child(__file__, [*common, "--step", "export", "--dtype", dtype, "--moe", moe]
                                           + (["--whole"] if extra == ["whole"] else [])
                                           + (["--quantize", extra[0]] if extra in (["int4"], ["int8"]) else [])))
    report["load_after"] = uptime()
    shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
