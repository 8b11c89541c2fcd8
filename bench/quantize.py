"""fp32 vs int8 vs int4 weight-only artifacts: bytes, load time, peak RSS, per-call ms.

    OMP_WAIT_POLICY=PASSIVE python bench/quantize.py [--work /tmp/dflash-quant] [--layers 28]
        [--threads 2] [--tau 4.67] [--demo] [--json]

1. A random fp32 Qwen3 target of Qwen3-0.6B's shape by default (28 layers, hidden 1024,
   16/8 heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings) and a
   1-layer drafter (block 16), written with bench/export_2gb.py's checkpoint writer.
2. `export` (fp32), then `quantize` into int8 and int4 (target and drafter linear layers
   and the LM head, block 32, symmetric), and int4 with MatMulNBits accuracy_level 4.
3. Per artifact, in a child process of its own: load time (manifest sha256 + ORT sessions)
   and peak RSS after a few calls. Then one process holds all artifacts and times a
   1-token step, a K-token verify and a draft block at context 128 (median of --repeats,
   best of --passes interleaved passes, as bench/context_scaling.py), so the ratios come
   from one run. Ideal speculative speedup = tau * step / (draft + verify), at --tau (the
   shipped demo pair's held-out tau by default).
4. With --demo: the shipped demo pair exported fp32, int8 and int4: tau and tokens/s of
   speculative and plain decoding on the demo prompts (cmd_run.run_bench).
Goals (docs/quantization.md): int4 linear weights <= 0.2x their fp32 bytes; int4 plain
step >= 2.5x faster than fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from common import ROOT, make_checkpoint, peak_rss_bytes, run_child

VARIANTS = {  # name -> QuantOptions arguments (None: the float export itself)
    "fp32": None,
    "int8": dict(scheme="int8", block_size=32, draft=True, lm_head=True),
    "int4": dict(scheme="int4", block_size=32, draft=True, lm_head=True),
    "int4-acc4": dict(scheme="int4", block_size=32, draft=True, lm_head=True, accuracy_level=4),
}


def linear_bytes(out: Path) -> dict:
    """Bytes of the linear weights (shared ones once): quantized tensors vs the same weights in fp32."""
    import onnx

    from dflash_export.runtime import contract as C, manifest as M

    m = M.load_manifest(out, verify=False)
    weights = m.quantization["weights"] if m.quantization else None
    seen, stored, fp32 = set(), 0, 0
    for g, f in C.GRAPH_FILES.items():
        model = onnx.load(str(out / f), load_external_data=False)
        size = {}
        for t in model.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            size[t.name] = (int(ext["length"]) if "length" in ext else len(t.raw_data), list(t.dims))
        names = weights.get(g, []) if weights else None
        if names is None:  # float artifact: every constant MatMul weight is a linear weight
            inits = set(size)
            names = [n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
            names += [n.input[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in inits]
        for w in names:
            if w in seen:
                continue
            seen.add(w)
            if weights:
                parts = [n for n in size if n.startswith(w + "_") and n[len(w) + 1:] in
                         (f"Q{m.quantization['bits']}", "scales", "zero_points")]
                stored += sum(size[n][0] for n in parts)
                node = next(a for a in model.graph.node if a.op_type == "MatMulNBits" and a.input[1].startswith(w + "_"))
                attr = {x.name: x.i for x in node.attribute}
                fp32 += 4 * attr["K"] * attr["N"]
            else:
                stored += size[w][0]
                fp32 += size[w][0]
    return {"linear_bytes": stored, "linear_fp32_bytes": fp32, "linear_ratio": stored / fp32}


def step_load(out: Path, threads: int) -> dict:
    """Child: load time and peak RSS of one artifact in the runtime (a few calls included)."""
    from context_scaling import time_calls

    from dflash_export.runtime.ort.backend import OrtBackend

    t0 = time.perf_counter()
    be = OrtBackend(out, threads=threads)
    load_s = time.perf_counter() - t0
    time_calls(be, 128, 2)
    return {"load_s": load_s, "peak_rss": peak_rss_bytes()}


def build(work: Path, a) -> dict[str, Path]:
    """Checkpoint, fp32 export and the quantized artifacts (each step skipped when present)."""
    from dflash_export.export.artifact import export_artifact
    from dflash_export.export.quantize import QuantOptions, quantize_artifact

    if not (work / "draft" / "config.json").is_file():
        make_checkpoint(work, a.vocab, a.hidden, a.layers, a.intermediate, heads=a.heads, kv_heads=a.kv_heads, tie=True)
    outs = {}
    for name, q in VARIANTS.items():
        out = work / name
        if not (out / "manifest.json").is_file():
            t0 = time.perf_counter()
            if q is None:
                export_artifact(work / "target", work / "draft", out, max_context=512, force=True, progress=True)
            else:
                quantize_artifact(work / "fp32", out, QuantOptions(**q), force=True, progress=True)
            print(f"{name}: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        outs[name] = out
    return outs


def timings(outs: dict[str, Path], threads: int, repeats: int, passes: int) -> dict:
    from context_scaling import time_calls

    from dflash_export.runtime.ort.backend import OrtBackend

    bes = {n: OrtBackend(o, threads=threads) for n, o in outs.items()}
    best: dict = {}
    for _ in range(passes):  # interleaved: load drifts hit every artifact alike
        for n, be in bes.items():
            r = time_calls(be, 128, repeats)
            best[n] = {k: min(v, best.get(n, {}).get(k, v)) for k, v in r.items()}
    return best


def demo(work: Path, threads: int, prompts: int, max_new_tokens: int) -> dict:
    from common import export_pair

    from dflash_export.runtime.measure import run_bench
    from dflash_export.export.quantize import QuantOptions, quantize_artifact
    from dflash_export.runtime.ort.backend import OrtBackend

    fp32 = export_pair(ROOT / "demo/pair/target", ROOT / "demo/pair/draft")
    outs = {"fp32": fp32}
    for name in ("int8", "int4"):
        outs[name] = work / f"demo-{name}"
        if not (outs[name] / "manifest.json").is_file():
            quantize_artifact(fp32, outs[name], QuantOptions(**VARIANTS[name]), force=True, progress=False)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fp32 / "tokenizer.json"))
    lines = (ROOT / "demo/prompts.jsonl").read_text().splitlines()[:prompts]
    ids = [tok.encode(json.loads(ln)["prompt"]).ids for ln in lines]
    res = {n: run_bench(OrtBackend(o, threads=threads), ids, max_new_tokens) for n, o in outs.items()}
    base = res["fp32"]["tokens_per_second"]["autoregressive"]
    return {n: {"tau": r["tau"], "tokens_per_second": r["tokens_per_second"], "speedup_own_plain": r["speedup"],
                "speculative_vs_fp32_plain": r["tokens_per_second"]["speculative"] / base,
                "ms_per_call": r["ms_per_call"], "lossless": r["lossless"]} for n, r in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-quant"))
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--tau", type=float, default=4.67, help="acceptance length for the ideal speedup (demo pair, README)")
    ap.add_argument("--demo", action="store_true", help="also the shipped demo pair with int8/int4")
    ap.add_argument("--demo-prompts", type=int, default=8)
    ap.add_argument("--demo-tokens", type=int, default=96)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.step:  # child: load one artifact
        print(json.dumps(step_load(Path(a.step), a.threads)))
        return
    a.work.mkdir(parents=True, exist_ok=True)
    outs = build(a.work, a)
    report = {"shape": dict(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, head_dim=128,
                            intermediate=a.intermediate, vocab=a.vocab, tied=True, draft_layers=1, block=16),
              "threads": a.threads, "tau": a.tau, "artifacts": {}}
    for name, out in outs.items():
        r = {"bytes": sum(p.stat().st_size for p in out.iterdir()), **linear_bytes(out)}
        r.update(run_child(__file__, ["--step", str(out), "--threads", str(a.threads)]))
        report["artifacts"][name] = r
    ms = timings(outs, a.threads, a.repeats, a.passes)
    fp = report["artifacts"]["fp32"]
    for name, r in report["artifacts"].items():
        r["ms"] = ms[name]
        r["ideal_speedup"] = a.tau * ms[name]["step"] / (ms[name]["draft"] + ms[name]["verify"])
        r["step_speedup_vs_fp32"] = ms["fp32"]["step"] / ms[name]["step"]
        r["linear_bytes_vs_fp32"] = r["linear_bytes"] / fp["linear_bytes"]
    if a.demo:
        report["demo"] = demo(a.work, 1, a.demo_prompts, a.demo_tokens)
    if a.json:
        print(json.dumps(report, indent=2))
        return
    print(f"target {report['shape']} + 1-layer drafter; ORT CPU, {a.threads} thread(s); context 128")
    print(f"{'artifact':>10} {'MiB':>8} {'linear':>7} {'load s':>7} {'RSS MiB':>8} {'step':>7} {'verify':>7} "
          f"{'draft':>7} {'step x':>7} {'ideal':>6}")
    for name, r in report["artifacts"].items():
        print(f"{name:>10} {r['bytes'] / 2**20:>8.0f} {r['linear_bytes_vs_fp32']:>7.3f} {r['load_s']:>7.1f} "
              f"{r['peak_rss'] / 2**20:>8.0f} {r['ms']['step']:>7.1f} {r['ms']['verify']:>7.1f} {r['ms']['draft']:>7.1f} "
              f"{r['step_speedup_vs_fp32']:>7.2f} {r['ideal_speedup']:>6.2f}")
    for name, r in report.get("demo", {}).items():
        print(f"demo {name}: tau {r['tau']:.2f}, speculative {r['tokens_per_second']['speculative']:.0f} tok/s, plain "
              f"{r['tokens_per_second']['autoregressive']:.0f} tok/s, speedup {r['speedup_own_plain']:.2f}x over its own "
              f"plain, {r['speculative_vs_fp32_plain']:.2f}x over fp32 plain, lossless {r['lossless']}")


if __name__ == "__main__":
    main()
