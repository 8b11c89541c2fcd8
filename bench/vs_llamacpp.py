"""Peer benchmark: llama.cpp (the CPU engine users would pick instead) vs dflash-export, same weights.

llama.cpp: bench/llamacpp.py (the llama-cpp-python 0.3.36 sdist's vendored source, built with
BUILD_FLAGS; checkpoints converted with its own convert_hf_to_gguf.py, quantized with llama-quantize).
Both sides get the same threads and token counts, greedy, each run in its own process whose own
peak RSS is read, ours and llama.cpp's measurements interleaved (--repeats rounds; the best of
each side's rounds is kept, as a loaded machine only ever slows a run down):

  demo         the shipped trained pair. plain: llama-completion vs `generate --no-draft`;
               spec: llama-speculative-simple --spec-type draft-dflash vs our speculative `bench`
  qwen3-0.6b, qwen3-1.7b, qwen3-4b (SHAPES; `NAME:LAYERS` for a reduced depth): random weights of
               the real widths and vocabulary, tied embeddings, plain decoding only.
               plain: llama-bench tg at the prompt's depth vs our decode rate (random prompt of
               --depth tokens); prefill: llama-bench pp512 vs 512 / our time to first token of a
               512-token prompt (target only, the runtime's default chunk)
  qwen3-30b-a3b (MOE_SHAPES; `qwen3-30b-a3b:2` for 2 layers): Qwen3-30B-A3B's layer shape, 128
               experts of width 768, top 8, random bf16 weights in the released checkpoint's layout
               (bench/moe_export.py); ours exported `--moe op`, quantized experts as QMoE.
               plain: as above; verify8: llama-bench pp8 at the prompt's depth (one 8-token batch)
               vs one target call of 8 positions after the prompt (what a verify of 8 costs us)

Formats: fp32 vs F32, int8 vs Q8_0, int4 vs Q4_0. Ours quantizes the linear layers, the LM head
and the embedding lookup (`--quantize X --quantize-lm-head --quantize-embedding`; the MatMulNBits
accuracy level measured per artifact, or --accuracy-level), as llama.cpp's quantized files do.

    python bench/vs_llamacpp.py [--model demo,qwen3-0.6b,qwen3-1.7b:8] [--threads 1,2] [--formats fp32,int8,int4]
        [--max-new-tokens 64] [--depth 64] [--repeats 2] [--accuracy-level auto|0|4] [--quant-block-size N]
        [--attention standard|ort] [--spin [--spin-us 50]] [--cpus 2,3] [--ours int4=DIR] [--json]

The last line of stdout is the JSON list of rows: {model, format, llama_format, threads, mode,
ours_tok_s, llama_tok_s, ratio (ours / llama.cpp), ...}; above it the table (or with --json one
JSON object: meta with both builds' flags and the load, and the goals).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, source_digest
from llamacpp import (BUILD_FLAGS, CACHE, LLAMA_QUANT, VERSION, build_flags, build_llamacpp, convert, llama_bench,  # noqa: F401
                      llama_commit, llama_dflash, llama_plain, llama_tokens, prompt_file, quantize, run)

# Real widths and vocabularies (the official configs); `layers` is the real depth, --model NAME:L reduces it.
SHAPES = {
    "qwen3-0.6b": dict(vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
    "qwen3-1.7b": dict(vocab=151936, hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144),
    "qwen3-4b": dict(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728),
}
MOE_SHAPES = {"qwen3-30b-a3b": dict(layers=48)}  # bench/moe_export.py SHAPE: the widths; `layers` the real depth
PREFILL_TOKENS = 512  # llama-bench's pp512
VERIFY_TOKENS = 8  # the MoE rows' verify: llama-bench pp8


def row(base: dict, mode: str, ours: float, llama: float, **extra) -> dict:
    return base | {"mode": mode, "ours_tok_s": ours, "llama_tok_s": llama, "ratio": ours / llama if llama else None} | extra


# -- ours --------------------------------------------------------------------------------------


def cli() -> list[str]:
    return [sys.executable, "-c", "from dflash_export.cli import main; main()"]


def export(target: Path, draft: Path, key: str, max_context: int, quant: list[str] | None = None,
           base: Path | None = None, attention: str = "standard", block_size: int | None = None) -> Path:
    """`dflash-export export` through the CLI (picks up whatever main has), cached by key and sources.
    Quantized: `dflash-export quantize` of the fp32 export where that command exists, else `export --quantize`.
    base: an existing fp32 export of the same checkpoints to use (and quantize) instead of exporting."""
    fp32 = quant is None
    if fp32 and base is not None:
        return base
    what = [key, quant or [], max_context, source_digest()] + ([str(base)] if base else [])
    what += [attention] if attention != "standard" else []  # older cache keys stay valid
    what += [f"block {block_size}"] if block_size else []
    digest = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]
    out = CACHE / "ours" / f"{target.parent.name}-{digest}"
    if (out / "manifest.json").is_file():
        return out
    print(f"exporting {target} {' '.join(quant or [])}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    if not fp32 and " quantize " in run([*cli(), "--help"]).out:
        base = export(target, draft, key, max_context, base=base, attention=attention, block_size=block_size)
        run([*cli(), "quantize", base, "--out", out, "--force", "--quiet", *quant], env=env, nice=True)
    else:
        run([*cli(), "export", "--target", target, "--draft", draft, "--out", out, "--max-context", max_context,
             "--force", "--quiet", "--attention", attention, *(["--block-size", block_size] if block_size else []),
             *(quant or [])], env=env, nice=True)
    return out


def ours_bench(out: Path, prompts_file: Path, n: int, threads: int) -> dict:
    r = run([*cli(), "bench", out, "--prompts", prompts_file, "--max-new-tokens", n, "--threads", threads, "--json"])
    rep = json.loads(r.out)
    return rep | {"rss_mb": r.rss_mb}


def ours_generate(out: Path, prompt: str, n: int, threads: int, draft: bool) -> dict:
    r = run([*cli(), "generate", out, "--prompt", prompt, "--max-new-tokens", n, "--threads", threads, "--json",
             *([] if draft else ["--no-draft"])])
    g = json.loads(r.out)
    steps = max(1, len(g["tokens"]) - 1)
    return g | {"rss_mb": r.rss_mb, "ms_per_token": g["time_s"]["verify"] / steps * 1e3}


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def same_text(ours: str, theirs: str) -> str:
    """'identical', or how far the two agree (the speculative example may run past n tokens)."""
    if ours == theirs or (theirs.startswith(ours) and ours):
        return "identical"
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"first {k}/{len(ours)} chars"


def demo_prompts(n: int) -> list[str]:
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(ln)["prompt"] for ln in lines if ln.strip()][:n]


def compare_demo(src: Path, bins: Path, a) -> list[dict]:
    from tokenizers import Tokenizer

    tdir, ddir = ROOT / "demo" / "pair" / "target", ROOT / "demo" / "pair" / "draft"
    gdir = CACHE / "gguf" / "demo"
    tg, dg = convert(src, tdir, gdir / "target-f32.gguf"), convert(src, ddir, gdir / "draft-f32.gguf", tdir)
    key = hashlib.sha256((tdir / "model.safetensors").read_bytes() + (ddir / "model.safetensors").read_bytes())
    out = export(tdir, ddir, key.hexdigest(), a.max_context, attention=a.attention, block_size=a.block_size)
    if a.calibrate and not (out / "runtime.json").is_file():  # threads + adaptive verify, on bench's built-in prompts
        print(f"calibrating {out}", file=sys.stderr)
        run([*cli(), "bench", out, "--calibrate", "--max-new-tokens", a.max_new_tokens, "--json"])
    prompts = demo_prompts(a.prompts)
    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    work = Path(tempfile.mkdtemp(prefix="vs_llamacpp."))
    pfiles = [prompt_file(work / f"p{i}", p) for i, p in enumerate(prompts)]
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    tok_same = all(llama_tokens(bins, tg, f) == tok.encode(p).ids for f, p in zip(pfiles, prompts))
    depth = round(sum(len(tok.encode(p).ids) for p in prompts) / len(prompts))
    rows = []
    for t in a.threads:
        lb = llama_bench(bins, tg, t, n=a.max_new_tokens, depth=depth)
        plain = [llama_plain(bins, tg, f, a.max_new_tokens, t, a.max_context) for f in pfiles]
        spec = [llama_dflash(bins, tg, dg, f, p, a.max_new_tokens, t, a.max_context, a.n_max)
                for f, p in zip(pfiles, prompts)]
        ob = ours_bench(out, work / "prompts.jsonl", a.max_new_tokens, t)
        ours_text = [ours_generate(out, p, a.max_new_tokens, t, draft=True)["text"] for p in prompts]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        detail = {
            "llama": {
                "bench_tok_s": lb["tok_s"], "plain_tok_s": mean([r["tok_s"] for r in plain]),
                "plain_ms_per_token": mean([r["ms_per_token"] for r in plain]),
                "dflash_tok_s": mean([r["tok_s"] for r in spec]), "dflash_tau": mean([r["tau"] for r in spec]),
                "dflash_ms_per_round": mean([r["ms_per_round"] for r in spec]),
                "rss_mb_plain": max(r["rss_mb"] for r in plain), "rss_mb_dflash": max(r["rss_mb"] for r in spec),
                "file_mb": (tg.stat().st_size + dg.stat().st_size) / 1e6,
            },
            "ours": {
                "plain_tok_s": ob["tokens_per_second"]["autoregressive"], "spec_tok_s": ob["tokens_per_second"]["speculative"],
                "tau": ob["tau"], "mean_verify_len": ob.get("mean_verify_len"), "ms_per_call": ob["ms_per_call"],
                "rss_mb": ob["rss_mb"], "file_mb": dir_mb(out),
                "lossless": ob["lossless"],
            },
            "prompt_tokens_identical": tok_same,
            "plain_output_vs_ours": [same_text(o, r["text"]) for o, r in zip(ours_text, plain)],
            "dflash_output_vs_ours": [same_text(o, r["text"]) for o, r in zip(ours_text, spec)],
        }
        L, O = detail["llama"], detail["ours"]
        base = {"model": "demo", "format": "fp32", "llama_format": "F32", "threads": t, "ours_rss_mb": O["rss_mb"],
                "ours_file_mb": O["file_mb"], "llama_file_mb": L["file_mb"]}
        rows.append(row(base, "plain", O["plain_tok_s"], L["plain_tok_s"], llama_rss_mb=L["rss_mb_plain"], detail=detail))
        rows.append(row(base, "spec", O["spec_tok_s"], L["dflash_tok_s"], llama_rss_mb=L["rss_mb_dflash"],
                        llama_mode="DFlash (llama-speculative-simple)", tau=O["tau"], llama_tau=L["dflash_tau"]))
    shutil.rmtree(work)
    return rows




# Our engine in a process of its own (its peak RSS is the engine's alone): plain decoding of a
# random prompt, then the time to first token of a 512-token one, through the runtime's own loop.
OURS_PROBE = r"""
import json, sys
import numpy as np
from dflash_export.runtime.calibrate import prefill_ms
from dflash_export.runtime.load import open_backend
from dflash_export.runtime.loop import generate
out, threads, depth, n, prefill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
verify, (how, _, bound) = int(sys.argv[6]), sys.argv[7].partition(" ")
spin, spin_us = how == "spin", int(bound) if bound else None
b = open_backend(out, "ort", "cpu", threads=threads, drafter=False, spin=spin, spin_us=spin_us)
rng = np.random.default_rng(0)
prompt = rng.integers(0, b.manifest.vocab_size, depth).tolist()
generate(b, prompt, 4, draft=False, stop_token_ids=())  # warm-up: shapes, pages
g = generate(b, prompt, n, draft=False, stop_token_ids=())
res = {"decode_tok_s": (len(g.tokens) - 1) / g.decode_s, "step_ms": g.decode_s / (len(g.tokens) - 1) * 1e3}
if verify:  # one target call of `verify` positions after the prompt, rolled back: a verify's cost
    import time
    b.reset()
    b.target(np.asarray(prompt, np.int64))
    b.commit(len(prompt))
    ids, times = np.asarray(g.tokens[:verify], np.int64), []
    for i in range(12):
        t0 = time.perf_counter()
        b.target(ids)
        if i >= 2:  # two warm-up calls
            times.append(time.perf_counter() - t0)
        b.commit(0)
    res["verify_ms"] = float(np.median(times)) * 1e3
if prefill:
    long = rng.integers(0, b.manifest.vocab_size, prefill).tolist()
    chunk = b.max_chunk
    res |= {"prefill_ms": prefill_ms(b, long, [chunk], repeats=1)[chunk], "prefill_chunk": chunk}
print(json.dumps(res))
"""


def ours_probe(out: Path, threads: int, depth: int, n: int, prefill: int = PREFILL_TOKENS, verify: int = 0,
               spin: bool = False, spin_us: int | None = None) -> dict:
    how = (f"spin {spin_us}" if spin_us else "spin") if spin else "no-spin"  # "spin 50": spinning bounded to 50 us
    r = run([sys.executable, "-c", OURS_PROBE, out, threads, depth, n, prefill, verify, how])
    return json.loads(r.out.strip().splitlines()[-1]) | {"rss_mb": r.rss_mb}


def our_options(fmt: str, level: str, block: int | None = None) -> list[str] | None:
    """`dflash-export quantize` options of our format (None: the fp32 export itself); block None: the default."""
    if fmt == "fp32":
        return None
    return (["--quantize", fmt, "--quantize-lm-head", "--quantize-embedding", "--quant-accuracy-level", level]
            + (["--quant-block-size", str(block)] if block else []))


def shape_checkpoint(name: str, layers: int) -> tuple[Path, Path, str]:
    """Random-weight checkpoint of SHAPES[name] at `layers` (+ a 1-layer drafter), the demo's tokenizer files."""
    p = SHAPES[name] | {"layers": layers}
    key = hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()[:8]
    d = CACHE / "models" / f"{name}-L{layers}-{key}"
    if not (d / "done").is_file():
        print(f"building the random {name}-shape checkpoint ({layers} layers)", file=sys.stderr)
        from dflash_export.models.tiny import make_drafter, make_target

        shutil.rmtree(d, ignore_errors=True)
        make_target(d / "target", "qwen3", tie=True, std=0.02, **p)
        for f in ("tokenizer.json", "tokenizer_config.json"):  # 4096 ids of 151936; the converter pads the rest
            shutil.copy(ROOT / "demo" / "pair" / "target" / f, d / "target" / f)
        make_drafter(d / "draft", d / "target", layers=1, block_size=16)
        (d / "done").touch()
    return d / "target", d / "draft", key


def moe_checkpoint(name: str, layers: int) -> tuple[Path, Path, str]:
    """Random bf16 checkpoint of Qwen3-30B-A3B's layer shape at `layers` (bench/moe_export.py, per-expert
    keys like the released one) + its 1-layer drafter, the demo's tokenizer files."""
    from moe_export import SHAPE, make_drafter as moe_drafter, make_target as moe_target

    key = hashlib.sha256(json.dumps([SHAPE, layers], sort_keys=True).encode()).hexdigest()[:8]
    d = CACHE / "models" / f"{name}-L{layers}-{key}"
    if not (d / "done").is_file():
        print(f"building the random {name}-shape checkpoint ({layers} layers)", file=sys.stderr)
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        moe_target(d / "target", layers, fused=False)
        for f in ("tokenizer.json", "tokenizer_config.json"):  # 4096 ids of 151936; the converter pads the rest
            shutil.copy(ROOT / "demo" / "pair" / "target" / f, d / "target" / f)
        moe_drafter(d / "target", d / "draft", layers)
        (d / "done").touch()
    return d / "target", d / "draft", key


def compare_moe(src: Path, bins: Path, name: str, layers: int, a) -> list[dict]:
    """plain and verify8 rows of the MoE shape, per format and thread count, the two engines interleaved."""
    tdir, ddir, key = moe_checkpoint(name, layers)
    gdir = CACHE / "gguf" / f"{name}-L{layers}-{key}"
    label = name if layers == MOE_SHAPES[name]["layers"] else f"{name}:{layers}"
    rows = []
    for fmt in a.formats:
        f32 = gdir / "target-f32.gguf"
        gguf = gdir / f"target-{LLAMA_QUANT[fmt].lower()}.gguf"
        if not gguf.is_file():
            convert(src, tdir, f32)
            if fmt != "fp32":
                gguf = quantize(bins, f32, LLAMA_QUANT[fmt])
        if fmt != "fp32" and f32.is_file() and not a.keep_f32:  # 4 bytes a weight: room on disk for the next one
            f32.unlink()
        out = a.ours.get(fmt) or export(tdir, ddir, f"{name}-{key}", a.max_context, our_options(fmt, a.accuracy_level, a.quant_block_size))
        base = base_record(label, layers, fmt, out, gguf)
        for t in a.threads:
            tg, pv, ours = [], [], []
            for _ in range(a.repeats):  # interleaved: a load spike hits one round of both
                tg.append(llama_bench(bins, gguf, t, n=a.max_new_tokens, depth=a.depth))
                ours.append(ours_probe(out, t, a.depth, a.max_new_tokens, prefill=0, verify=VERIFY_TOKENS, spin=a.spin,
                                       spin_us=a.spin_us))
                pv.append(llama_bench(bins, gguf, t, prompt=VERIFY_TOKENS, depth=a.depth, reps=10))
            best_pv, best_ver = max(pv, key=lambda r: r["tok_s"]), min(ours, key=lambda r: r["verify_ms"])
            b = base | {"threads": t, "ours_rss_mb": max(r["rss_mb"] for r in ours),
                        "llama_rss_mb": max(r["rss_mb"] for r in tg + pv)}
            rows.append(plain_row(b, ours, tg, a.depth))
            rows.append(row(b, "verify8", VERIFY_TOKENS / best_ver["verify_ms"] * 1e3, best_pv["tok_s"], depth=a.depth,
                            ours_ms=best_ver["verify_ms"], llama_ms=VERIFY_TOKENS / best_pv["tok_s"] * 1e3,
                            rounds={"ours_ms": [r["verify_ms"] for r in ours],
                                    "llama_ms": [VERIFY_TOKENS / r["tok_s"] * 1e3 for r in pv]}))
    return rows


def base_record(label: str, layers: int, fmt: str, out: Path, gguf: Path) -> dict:
    """What a row says of the two files compared: format, our quantization, sizes."""
    return {"model": label, "layers": layers, "format": fmt, "llama_format": LLAMA_QUANT[fmt], **quant_record(out),
            "ours_file_mb": target_mb(out), "ours_artifact_mb": dir_mb(out), "llama_file_mb": gguf.stat().st_size / 1e6}


def plain_row(b: dict, ours: list[dict], tg: list[dict], depth: int) -> dict:
    """The plain-decoding row: each side's best interleaved round (llama-bench tg against our decode)."""
    best_dec, best_tg = max(ours, key=lambda r: r["decode_tok_s"]), max(tg, key=lambda r: r["tok_s"])
    return row(b, "plain", best_dec["decode_tok_s"], best_tg["tok_s"], depth=depth, ours_ms=best_dec["step_ms"],
               llama_ms=best_tg["ms_per_token"],
               rounds={"ours": [r["decode_tok_s"] for r in ours], "llama": [r["tok_s"] for r in tg]})


def target_mb(out: Path) -> float:
    """The target's own files (its graph, its data, the shared tensors it reads): what the GGUF holds.
    The artifact's drafter graphs come on top (`ours_artifact_mb`)."""
    m = json.loads((out / "manifest.json").read_text())
    spans = {(t["file"], t["offset"], t["length"]) for t in m["shared"].values() if "target" in t["graphs"]}
    own = [out / "target.onnx", out / "target.data"]
    return (sum(f.stat().st_size for f in own if f.is_file()) + sum(s[2] for s in spans)) / 1e6


def quant_record(out: Path) -> dict:
    """The manifest's accuracy level and block size of a quantized export (None each for fp32)."""
    q = json.loads((out / "manifest.json").read_text()).get("quantization") or {}
    return {"accuracy_level": q.get("accuracy_level"), "quant_block_size": q.get("block_size")}


def compare_shape(src: Path, bins: Path, name: str, layers: int, a) -> list[dict]:
    """plain and prefill rows of one shape, per format and thread count, the two engines interleaved."""
    tdir, ddir, key = shape_checkpoint(name, layers)
    f32 = convert(src, tdir, CACHE / "gguf" / f"{name}-L{layers}-{key}" / "target-f32.gguf")
    label = name if layers == SHAPES[name]["layers"] else f"{name}:{layers}"
    rows = []
    for fmt in a.formats:
        gguf = f32 if fmt == "fp32" else quantize(bins, f32, LLAMA_QUANT[fmt])
        out = a.ours.get(fmt) or export(tdir, ddir, f"{name}-{key}", a.max_context, our_options(fmt, a.accuracy_level, a.quant_block_size),
                                        attention=a.attention)
        base = base_record(label, layers, fmt, out, gguf)
        for t in a.threads:
            tg, pp, ours = [], [], []
            for _ in range(a.repeats):  # interleaved: a load spike hits one round of both
                tg.append(llama_bench(bins, gguf, t, n=a.max_new_tokens, depth=a.depth))
                ours.append(ours_probe(out, t, a.depth, a.max_new_tokens, spin=a.spin, spin_us=a.spin_us))
                pp.append(llama_bench(bins, gguf, t, prompt=PREFILL_TOKENS))
            best_pp, best_pre = max(pp, key=lambda r: r["tok_s"]), min(ours, key=lambda r: r["prefill_ms"])
            b = base | {"threads": t, "ours_rss_mb": max(r["rss_mb"] for r in ours),
                        "llama_rss_mb": max(r["rss_mb"] for r in tg + pp)}
            rows.append(plain_row(b, ours, tg, a.depth))
            rows.append(row(b, "prefill", PREFILL_TOKENS / best_pre["prefill_ms"] * 1e3, best_pp["tok_s"],
                            ours_ms=best_pre["prefill_ms"], llama_ms=PREFILL_TOKENS / best_pp["tok_s"] * 1e3,
                            prefill_chunk=best_pre["prefill_chunk"],
                            rounds={"ours": [PREFILL_TOKENS / r["prefill_ms"] * 1e3 for r in ours],
                                    "llama": [r["tok_s"] for r in pp]}))
    return rows


def goals(rows: list[dict]) -> list[dict]:
    """What each row is held to: ours >= llama.cpp in speed; quantized files within 1.3x of the GGUF's."""
    res = []
    for r in rows:
        if r["model"] == "demo" or r["format"] == "fp32":
            continue
        what = f"{r['model']} {r['format']} vs {r['llama_format']}, {r['threads']} thread(s), {r['mode']}"
        res.append({"goal": f"{what}: ours >= 1.0x llama.cpp tok/s", "ratio": r["ratio"], "met": r["ratio"] >= 1.0})
    for r in {(r["model"], r["format"]): r for r in rows if r["model"] != "demo" and r["format"] != "fp32"}.values():
        ratio = r["ours_file_mb"] / r["llama_file_mb"]
        res.append({"goal": f"{r['model']} {r['format']}: files <= 1.3x {r['llama_format']}'s", "ratio": ratio,
                    "met": ratio <= 1.3})
    return res


def print_table(rows: list[dict], gl: list[dict], meta: dict) -> None:
    print(f"llama.cpp {meta['llamacpp']} ({' '.join(meta['llamacpp_build'])}) vs dflash-export {meta['ours']} "
          f"(onnxruntime {meta['onnxruntime']}); load {meta['loadavg_start']} -> {meta['loadavg_end']}")
    hdr = ("model", "format", "thr", "mode", "llama tok/s", "ours tok/s", "ratio", "RSS MB llama|ours", "files MB llama|ours", "acc")
    lines = [hdr]
    for r in rows:
        lines.append((r["model"], f"{r['format']}/{r['llama_format']}", str(r["threads"]), r["mode"], f"{r['llama_tok_s']:.1f}",
                      f"{r['ours_tok_s']:.1f}", f"{r['ratio']:.2f}", f"{r.get('llama_rss_mb', 0):.0f} | {r['ours_rss_mb']:.0f}",
                      f"{r['llama_file_mb']:.0f} | {r['ours_file_mb']:.0f}", str(r.get("accuracy_level", "-"))))
    widths = [max(len(x[i]) for x in lines) for i in range(len(hdr))]
    for ln in lines:
        print("  ".join(c.ljust(w) for c, w in zip(ln, widths)).rstrip())
    for g in gl:
        print(f"{'MET    ' if g['met'] else 'NOT MET'} {g['goal']}: {g['ratio']:.2f}x")


def parse_models(spec: str) -> list[tuple[str, int]]:
    out = []
    for m in spec.split(","):
        name, _, layers = m.partition(":")
        if name != "demo" and name not in SHAPES and name not in MOE_SHAPES:
            raise SystemExit(f"--model: unknown {name}; choose demo, {', '.join([*SHAPES, *MOE_SHAPES])} "
                             "(NAME:LAYERS for a reduced depth)")
        out.append((name, int(layers) if layers else (SHAPES | MOE_SHAPES).get(name, {}).get("layers", 0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo,qwen3-0.6b",
                    help="comma-separated: demo, " + ", ".join([*SHAPES, *MOE_SHAPES]) + " (NAME:LAYERS)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, same on both sides")
    ap.add_argument("--prompts", type=int, default=3, help="demo/prompts.jsonl prompts (demo model)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=64, help="shapes: the prompt's length before decoding (llama-bench -d)")
    ap.add_argument("--repeats", type=int, default=2, help="shapes: interleaved rounds per row (the best is kept)")
    ap.add_argument("--formats", default="fp32,int8,int4", help="shapes: of fp32, int8, int4 (vs F32, Q8_0, Q4_0)")
    ap.add_argument("--accuracy-level", default="auto", choices=["auto", "0", "1", "2", "3", "4"],
                    help="our MatMulNBits accuracy level (quantize --quant-accuracy-level)")
    ap.add_argument("--quant-block-size", type=int, default=None,
                    help="our quantized exports' block size (quantize --quant-block-size) [default: the quantizer's]")
    ap.add_argument("--max-context", type=int, default=2048, help="KV capacity, both sides (llama -c)")
    ap.add_argument("--n-max", type=int, default=15, help="llama.cpp --spec-draft-n-max (DFlash block 16 = 15 drafts)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="demo: our draft_block's K (export --block-size) [default: the drafter's, 16]")
    ap.add_argument("--attention", default="standard", choices=["standard", "ort"],
                    help="our export's attention flavour (export --attention)")
    ap.add_argument("--calibrate", action="store_true",
                    help="demo: `bench --calibrate` our export once (runtime.json: adaptive verify, on bench's "
                         "built-in prompts, not the measured ones); without it ours verifies the full block")
    ap.add_argument("--ours", action="append", default=[], metavar="FORMAT=DIR",
                    help="shapes: our export of FORMAT to use as is (one shape); else exported here, cached by the "
                         "exporter's source, which any change to it re-exports")
    ap.add_argument("--keep-f32", action="store_true", help="MoE shapes: keep the F32 GGUF after quantizing it")
    ap.add_argument("--spin", action="store_true",
                    help="shapes: ours with ONNX Runtime's intra-op spinning on (`--spin`; off by default, as on a "
                         "shared machine it slows every call; llama.cpp's threads spin by default)")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="shapes: with --spin, idle workers spin at most this many microseconds, then block "
                         "(ONNX Runtime's session.intra_op.spin_duration_us) [default: no bound]")
    ap.add_argument("--cpus", default=None,
                    help="comma-separated CPU ids both engines are pinned to (as taskset; children inherit it), for "
                         "a quiet many-core machine: e.g. --threads 1,2 --cpus 2,3")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.cpus:
        os.sched_setaffinity(0, {int(c) for c in a.cpus.split(",")})
    a.ours = {f: Path(d) for f, _, d in (x.partition("=") for x in a.ours)}
    a.threads = [int(x) for x in a.threads.split(",")]
    a.formats = a.formats.split(",")
    if bad := set(a.formats) - set(LLAMA_QUANT):
        raise SystemExit(f"--formats: unknown {', '.join(sorted(bad))}; choose from {', '.join(LLAMA_QUANT)}")
    models = parse_models(a.model)
    src, bins = build_llamacpp()
    import onnxruntime

    load_start = os.getloadavg()
    rows = []
    for name, layers in models:
        if name == "demo":
            rows += compare_demo(src, bins, a)
        else:
            rows += (compare_moe if name in MOE_SHAPES else compare_shape)(src, bins, name, layers, a)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    meta = {"llamacpp": f"{llama_commit()} (llama-cpp-python {VERSION} sdist)", "llamacpp_build": build_flags(),
            "ours": head.strip(), "onnxruntime": onnxruntime.__version__, "max_new_tokens": a.max_new_tokens,
            "depth": a.depth, "repeats": a.repeats, "threads": a.threads, "cpu_count": os.cpu_count(),
            "cpu": cpu_name(), "machine": platform.machine(), "attention": a.attention, "block_size": a.block_size,
            "calibrated": a.calibrate, "accuracy_level": a.accuracy_level, "quant_block_size": a.quant_block_size,
            "spin": a.spin, "spin_us": a.spin_us, "cpus": a.cpus, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    gl = goals(rows)
    if a.json:
        print(json.dumps({"meta": meta, "goals": gl}))
    else:
        print_table(rows, gl, meta)
    print(json.dumps(rows))


def cpu_name() -> str:
    for ln in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if ln.startswith("model name"):
            return ln.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
