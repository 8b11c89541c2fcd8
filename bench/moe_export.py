"""Peak memory of exporting a Qwen3-30B-A3B-shaped MoE target, whose experts are streamed.

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python bench/moe_export.py --work /tmp/moe-export --layers 2

Qwen3-30B-A3B's layer shape with real widths (hidden 2048, 32 query / 4 KV heads of 128,
128 experts of width 768, 8 per token, vocab 151936) at reduced depth, random bf16 weights
written the way the released checkpoint is (one safetensors shard per layer, per-expert keys;
`--layout fused`: transformers 5.x's gate_up_proj / down_proj), plus a 1-layer drafter. Then,
each in a process of its own so its peak RSS is its own: `export_artifact` per dtype (and
path; `fp32:op:int4`: `export --quantize int4`, the float export then its quantization), its
peak RSS (VmHWM) against the artifact it wrote and against the fp32 size of the weights it
exports, and its peak disk: the bytes allocated under `--out` and its hidden staging folders
(the float export `.out.partial-PID`, the quantized one `.out.partial-qPID`), polled every
0.2 s. Prints one JSON object. `--step quantize --src FLOAT_EXPORT`: `quantize` alone, its
peak against the quantized artifact. Not part of the test suite (minutes, GBs of disk).

Old against new, in one run: `--old-code DIR` (a checkout of the code before, e.g. `git
worktree add /tmp/old <commit>`) and runs ending in `:old`, which import `dflash_export` from
DIR instead, e.g. `--layers 1 --runs fp32:op:int4:old,fp32:op:int4`.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from common import machine, parser, peak_rss_bytes, run_child, uptime

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


class DiskWatch:
    """Peak bytes allocated under `out` and its hidden staging siblings (`.out.*`), polled in a thread."""

    def __init__(self, out: Path, every: float = 0.2):
        self.out, self.every, self.peak = out, every, {"total": 0}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _size(self, p: Path) -> int:
        total = 0
        for f in p.rglob("*") if p.is_dir() else [p]:
            try:
                total += f.lstat().st_blocks * 512
            except OSError:  # renamed or removed while walking
                pass
        return total

    def sample(self) -> None:
        sizes = {}
        for p in self.out.parent.iterdir():
            if p.name == self.out.name or p.name.startswith(f".{self.out.name}."):
                kind = "output" if p.name == self.out.name else "quantized staging" if ".partial-q" in p.name \
                    else "float staging" if ".partial-" in p.name else "other"
                sizes[kind] = sizes.get(kind, 0) + self._size(p)
        for k, v in [*sizes.items(), ("total", sum(sizes.values()))]:
            self.peak[k] = max(self.peak.get(k, 0), v)

    def _poll(self) -> None:
        while not self.stop.wait(self.every):
            self.sample()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.sample()


def do_export(work: Path, dtype: str, moe: str, whole: bool, quantize: str | None = None, old_code: Path | None = None,
              level: int | None = None) -> dict:
    if old_code is not None:  # the code before: its dflash_export ahead of this checkout's (sys.path before the editable finder)
        sys.path.insert(0, str(old_code))
    import dflash_export
    from dflash_export.export.artifact import checkpoint_elements, export_artifact
    from dflash_export.export.quantize import QuantOptions

    if whole:  # the comparison: experts loaded with the rest of the checkpoint, as before streaming
        import contextlib

        from dflash_export.models import checkpoint
        checkpoint.experts_on_meta = contextlib.nullcontext
    out = work / f"out-{dtype}-{moe}"
    q = QuantOptions(quantize, accuracy_level=level) if quantize else None
    t0 = time.perf_counter()
    with DiskWatch(out) as disk:
        export_artifact(work / "target", work / "draft", out, dtype=dtype, moe=moe, max_context=1024, force=True,
                        progress=True, quantize=q)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    artifact = sum(f.stat().st_size for f in out.iterdir())
    fp32 = 4 * (checkpoint_elements(work / "target") + checkpoint_elements(work / "draft"))
    shutil.rmtree(out)  # room for the next one
    return {"dtype": dtype, "moe": moe, "quantize": quantize, "experts": "whole" if whole else "streamed",
            "code": str(Path(dflash_export.__path__[0])), "export_s": round(seconds, 1), "peak_rss": peak,
            "artifact_bytes": artifact, "fp32_weight_bytes": fp32, "peak_over_artifact": round(peak / artifact, 3),
            "peak_over_fp32_weights": round(peak / fp32, 3), "peak_disk": disk.peak,
            "peak_disk_over_artifact": round(disk.peak["total"] / artifact, 3)}


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
    ap = parser(__doc__, json_flag=False)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-moe-export"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--layout", choices=("per-expert", "fused"), default="per-expert")
    ap.add_argument("--runs", default="fp32:op,fp32:op:int4,fp16:standard,fp16:standard:whole",
                    help="dtype:moe[:whole|:int4|:int8][:old] exports, comma-separated (whole: experts loaded, not "
                         "streamed; int4 / int8: export --quantize, one process; old: with --old-code's dflash_export)")
    ap.add_argument("--step", choices=("make", "export", "quantize"))
    ap.add_argument("--src", type=Path, help="--step quantize: the float export to quantize")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--moe", default="op")
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--quantize", choices=("int4", "int8"))
    ap.add_argument("--old-code", type=Path, help="a checkout of the code before, for runs ending in :old")
    ap.add_argument("--accuracy-level", type=int, choices=(0, 4),
                    help="--quant-accuracy-level of the int4 / int8 runs (default: measured, the probe included)")
    args = ap.parse_args()
    if args.step == "make":
        print(json.dumps(do_make(args.work, args.layers, args.layout == "fused")))
        return
    if args.step == "quantize":
        print(json.dumps(do_quantize(args.src, args.quantize or "int4")))
        return
    if args.step == "export":
        print(json.dumps(do_export(args.work, args.dtype, args.moe, args.whole, args.quantize, args.old_code,
                                   args.accuracy_level)))
        return
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    common = ["--work", str(args.work), "--layers", str(args.layers), "--layout", args.layout]
    report = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
              "layers": args.layers, "layout": args.layout, "shape": SHAPE, "accuracy_level": args.accuracy_level,
              "old_code": str(args.old_code) if args.old_code else None,
              "machine": machine(), "load_before": uptime()}
    report["make"] = run_child(__file__, [*common, "--step", "make"])
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in (args.work / "target").iterdir())
    report["exports"] = []
    for run in args.runs.split(","):
        dtype, moe, *extra = run.split(":")
        if "old" in extra and args.old_code is None:
            raise SystemExit(f"{run}: a run ending in :old needs --old-code DIR")
        report["exports"].append(run_child(__file__, [*common, "--step", "export", "--dtype", dtype, "--moe", moe]
                                           + (["--whole"] if "whole" in extra else [])
                                           + [a for x in extra if x in ("int4", "int8") for a in ("--quantize", x)]
                                           + (["--old-code", str(args.old_code)] if "old" in extra else [])
                                           + ([] if args.accuracy_level is None else
                                              ["--accuracy-level", str(args.accuracy_level)])))
        report["exports"][-1]["load_after"] = uptime()
    report["load_after"] = uptime()
    shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
