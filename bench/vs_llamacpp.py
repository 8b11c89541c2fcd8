"""Peer benchmark: llama.cpp (the CPU engine users would pick instead) vs dflash-export, same weights.

llama.cpp is built from the source that the llama-cpp-python 0.3.36 sdist vendors (pip download,
cmake Release, native CPU, -j2; cached under ~/.cache/dflash-export/llamacpp), the checkpoints
are converted with its own convert_hf_to_gguf.py and quantized with llama-quantize. Then, on the
same prompts, threads and token counts, both greedy:

  llama.cpp   llama-bench (tg at the prompt's depth), llama-completion (plain greedy, text),
              llama-speculative-simple --spec-type draft-dflash (its DFlash path)
  ours        `dflash-export bench` (speculative + plain, interleaved), `generate --json` (text)

Each process is timed on its own and its peak RSS read with wait4. Outputs are compared as text
where the formats allow (same fp32 weights); prompt tokenization is compared token for token.

Models: `demo` = the shipped trained pair (demo/pair); `qwen3-0.6b` = a random-weight target of
Qwen3-0.6B's shape (28 layers, hidden 1024, 16/8 heads, head_dim 128, vocab 151936, tied),
plain decoding only (a random drafter accepts nothing), fp32 vs F32, int8 vs Q8_0, int4 vs Q4_0
(--formats; int4-acc4 = int4 at MatMulNBits accuracy level 4).

    python bench/vs_llamacpp.py [--model demo,qwen3-0.6b] [--threads 1,2] [--prompts 3]
        [--max-new-tokens 64] [--layers 28] [--formats fp32,int8,int4] [--attention standard|ort] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, source_digest

VERSION = "0.3.36"  # llama-cpp-python sdist; vendors llama.cpp 0c1e570
CACHE = Path(os.environ.get("DFLASH_LLAMACPP_CACHE", Path.home() / ".cache/dflash-export/llamacpp"))
BINARIES = ["llama-bench", "llama-quantize", "llama-completion", "llama-speculative-simple", "llama-tokenize",
            "llama-server"]  # llama-server: bench/vs_llamaserver.py
# The demo's tokenizer is a ByteLevel BPE with the GPT-2 split regex (use_regex=true): llama.cpp's "gpt-2"
# pre-tokenizer is that regex. The converter only knows tokenizers by the hash of a test string, so we
# choose the pre-tokenizer for hashes it does not know by wrapping its get_vocab_base_pre (no file edited).
PRE_TOKENIZER = "gpt-2"
CONVERT = r"""
import sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, src + "/gguf-py"]
import convert_hf_to_gguf
from conversion import base

known = base.TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print(f"vs_llamacpp: tokenizer hash unknown to the converter; pre-tokenizer {pre!r}", file=sys.stderr)
        return pre

base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
convert_hf_to_gguf.main()
"""
QWEN3_06B = dict(vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072)
LLAMA_QUANT = {"int8": "Q8_0", "int4": "Q4_0"}  # our --quantize -> the llama.cpp format it is compared with


@dataclass
class Run:
    out: str
    err: str
    rss_mb: float
    wall_s: float


def run(cmd: list, env: dict | None = None, nice: bool = False) -> Run:
    """Run a process to completion; its own peak RSS (wait4), not the sum over children seen so far."""
    name, cmd = Path(str(cmd[0])).name, (["nice", "-n", "19"] if nice else []) + [str(c) for c in cmd]
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        fo.seek(0), fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    if p.returncode != 0:
        tail = [ln for ln in (err + out).splitlines() if ln.strip()][-3:]
        raise SystemExit(f"{name} failed (exit {p.returncode}): " + " | ".join(tail))
    return Run(out, err, ru.ru_maxrss / 1024, wall)


def run_logged(cmd: list, pattern: str, tries: int = 6) -> Run:
    """Run a llama.cpp tool until its stderr has `pattern`: its logger is an async thread, and seen here
    under load, a process sometimes exits before the thread has written the last lines (perf, stats)."""
    for _ in range(tries):
        r = run(cmd)
        if re.search(pattern, r.err):
            return r
    raise SystemExit(f"{Path(str(cmd[0])).name}: no {pattern!r} in its log after {tries} runs")


# -- llama.cpp: source, build, conversion ------------------------------------------------------


def build_llamacpp(jobs: int = 2) -> tuple[Path, Path]:
    """(source dir, bin dir) of llama.cpp as vendored by the llama-cpp-python sdist; built once."""
    src = CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        sdist = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            print(f"downloading llama-cpp-python=={VERSION} sdist", file=sys.stderr)
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={VERSION}", "-d", CACHE])
        with tarfile.open(sdist) as tf:
            tf.extractall(CACHE, filter="data")
    build, bins = CACHE / "build", CACHE / "build" / "bin"
    if not all((bins / b).is_file() for b in BINARIES):
        print(f"building llama.cpp (Release, native CPU, -j{jobs}; tens of minutes on 2 cores)", file=sys.stderr)
        cached = build / "CMakeCache.txt"
        if not cached.is_file() or "LLAMA_BUILD_SERVER:BOOL=OFF" in cached.read_text():  # (builds before llama-server)
            run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_APP=OFF"], nice=True)
        run(["cmake", "--build", build, f"-j{jobs}", "--target", *BINARIES], nice=True)
    return src, bins


def llama_commit() -> str:
    m = re.search(r"LLAMA_BUILD_COMMIT\s+([0-9a-f]{7,})", (CACHE / "build" / "llama-config.cmake").read_text())
    return m.group(1) if m else "?"


def converter_deps() -> Path:
    """The converter's one dependency the project venv lacks (sentencepiece), in a side folder."""
    deps = CACHE / "pydeps"
    if not (deps / "sentencepiece").is_dir():
        run([sys.executable, "-m", "pip", "install", "-q", "--target", deps, "sentencepiece>=0.1.98,<0.3.0"])
    return deps


def convert(src: Path, model_dir: Path, out: Path, target_dir: Path | None = None) -> Path:
    """HF checkpoint -> F32 GGUF with llama.cpp's own converter (draft: tokenizer from target_dir)."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    extra = ["--target-model-dir", target_dir] if target_dir else []
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(converter_deps()))
    r = run([sys.executable, "-c", CONVERT, src, PRE_TOKENIZER, model_dir, "--outfile", tmp, "--outtype", "f32",
             *extra], env=env, nice=True)
    if "pre-tokenizer" in r.err and "vs_llamacpp" in r.err:
        print(f"{model_dir.name}: " + next(ln for ln in r.err.splitlines() if "vs_llamacpp" in ln), file=sys.stderr)
    os.replace(tmp, out)
    return out


def quantize(bins: Path, f32: Path, kind: str) -> Path:
    out = f32.with_name(f32.stem.replace("-f32", "") + f"-{kind.lower()}.gguf")
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        run([bins / "llama-quantize", f32, tmp, kind, "2"], nice=True)
        os.replace(tmp, out)
    return out


# -- llama.cpp: measurements -------------------------------------------------------------------


def prompt_file(stem: Path, prompt: str) -> Path:
    """`-f` files for llama.cpp: its -f drops one trailing newline, so write one extra; no escapes
    (--no-escape everywhere). llama-tokenize reads its file verbatim: it gets the .raw twin."""
    stem.with_suffix(".raw").write_text(prompt)
    stem.with_suffix(".txt").write_text(prompt + "\n")
    return stem.with_suffix(".txt")


def llama_tokens(bins: Path, gguf: Path, prompt_file: Path) -> list[int]:
    r = run([bins / "llama-tokenize", "-m", gguf, "-f", prompt_file.with_suffix(".raw"), "--ids", "--log-disable", "--no-escape"])
    return json.loads(r.out.strip().splitlines()[-1])


def llama_bench(bins: Path, gguf: Path, threads: int, n: int, depth: int) -> dict:
    """llama-bench tg: n tokens generated at context depth `depth` (the prompt's length)."""
    r = run([bins / "llama-bench", "-m", gguf, "-t", threads, "-p", 0, "-n", n, "-d", depth, "-r", 1, "-o", "json"])
    tps = json.loads(r.out)[0]["avg_ts"]
    return {"tok_s": tps, "ms_per_token": 1e3 / tps, "rss_mb": r.rss_mb}


EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs")  # "prompt eval" counts tokens, not runs


def llama_plain(bins: Path, gguf: Path, prompt_file: Path, n: int, threads: int, ctx: int) -> dict:
    """llama-completion, greedy: generated text, decode tok/s (its own eval timer), peak RSS."""
    r = run_logged([bins / "llama-completion", "-m", gguf, "-f", prompt_file, "-n", n, "--temp", 0, "-t", threads, "-c", ctx,
             "-no-cnv", "--no-display-prompt", "--simple-io", "--no-escape"], EVAL.pattern)
    ms, runs = map(float, EVAL.findall(r.err)[-1])
    text = r.out.removesuffix("\n").removesuffix(" [end of text]")
    return {"text": text, "tok_s": runs / ms * 1e3, "ms_per_token": ms / runs, "rss_mb": r.rss_mb}


def llama_dflash(bins: Path, tgt: Path, dft: Path, prompt_file: Path, prompt: str, n: int, threads: int, ctx: int,
                 n_max: int) -> dict:
    """llama-speculative-simple --spec-type draft-dflash, greedy: text, decode tok/s, tau, peak RSS."""
    r = run_logged([bins / "llama-speculative-simple", "-m", tgt, "-md", dft, "--spec-type", "draft-dflash",
             "--spec-draft-n-max", n_max, "-f", prompt_file, "-n", n, "--temp", 0, "--top-k", 1, "-t", threads,
             "-td", threads, "-c", ctx, "--no-escape"], r"n_accept\s*=")
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", r.err)
    n_pred, secs = int(m.group(1)), float(m.group(2))
    acc = int(re.search(r"n_accept\s*=\s*(\d+)", r.err).group(1))
    text = r.out.removeprefix("\n\n").removesuffix("\n\n")  # it prints "\n\n", prompt, output, "\n\n"
    text = text[len(prompt):] if text.startswith(prompt) else text
    rounds = max(1, n_pred - acc)  # each round yields its accepted drafts + 1
    return {"text": text, "tok_s": n_pred / secs, "tau": n_pred / rounds, "ms_per_round": secs / rounds * 1e3,
            "rss_mb": r.rss_mb}


# -- ours --------------------------------------------------------------------------------------


def cli() -> list[str]:
    return [sys.executable, "-c", "from dflash_export.cli import main; main()"]


def quant_variants() -> dict[str, list[str]]:
    """Our quantized formats this checkout supports: none, or int8/int4 once `export --quantize` exists
    (with the LM head quantized too where the option exists: the issue's int4 goal is stated with it),
    each also as `-acc4` (MatMulNBits accuracy level 4: int8 activations, ORT's fast CPU path)."""
    helptext = run([*cli(), "export", "--help"]).out
    if "--quantize" not in helptext:
        return {}
    extra = ["--quantize-lm-head"] if "--quantize-lm-head" in helptext else []
    out = {q: ["--quantize", q, *extra] for q in ("int8", "int4")}
    if "--quant-accuracy-level" in helptext:
        out |= {f"{q}-acc4": [*opts, "--quant-accuracy-level", "4"] for q, opts in list(out.items())}
    return out


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
        base = export(target, draft, key, max_context, base=base)
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


# -- models ------------------------------------------------------------------------------------


def demo_prompts(n: int) -> list[str]:
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(ln)["prompt"] for ln in lines if ln.strip()][:n]


def qwen3_06b(layers: int) -> tuple[Path, Path, str]:
    """Random-weight Qwen3-0.6B-shaped target (+ a 1-layer drafter), with the demo's tokenizer files."""
    p = QWEN3_06B | {"layers": layers}
    key = hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()[:8]
    d = CACHE / "models" / f"qwen3-0.6b-L{layers}-{key}"
    if not (d / "done").is_file():
        print(f"building the random Qwen3-0.6B-shape checkpoint ({layers} layers)", file=sys.stderr)
        from dflash_export.testing import make_drafter, make_target

        shutil.rmtree(d, ignore_errors=True)
        make_target(d / "target", "qwen3", tie=True, std=0.02, **p)
        for f in ("tokenizer.json", "tokenizer_config.json"):  # 4096 ids of 151936; the converter pads the rest
            shutil.copy(ROOT / "demo" / "pair" / "target" / f, d / "target" / f)
        make_drafter(d / "draft", d / "target", layers=1, block_size=16)
        (d / "done").touch()
    return d / "target", d / "draft", key


# -- the comparison ----------------------------------------------------------------------------


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
        lb = llama_bench(bins, tg, t, a.max_new_tokens, depth)
        plain = [llama_plain(bins, tg, f, a.max_new_tokens, t, a.max_context) for f in pfiles]
        spec = [llama_dflash(bins, tg, dg, f, p, a.max_new_tokens, t, a.max_context, a.n_max)
                for f, p in zip(pfiles, prompts)]
        ob = ours_bench(out, work / "prompts.jsonl", a.max_new_tokens, t)
        ours_text = [ours_generate(out, p, a.max_new_tokens, t, draft=True)["text"] for p in prompts]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        rows.append({
            "model": "demo", "format": "fp32 / F32", "threads": t,
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
        })
    shutil.rmtree(work)
    return rows


def compare_06b(src: Path, bins: Path, a) -> list[dict]:
    tdir, ddir, key = qwen3_06b(a.layers)
    gdir = CACHE / "gguf" / f"qwen3-0.6b-L{a.layers}-{key}"
    f32 = convert(src, tdir, gdir / "target-f32.gguf")
    prompt = demo_prompts(1)[0]
    pf = prompt_file(Path(tempfile.mkdtemp(prefix="vs_llamacpp.")) / "p", prompt)
    depth = len(llama_tokens(bins, f32, pf))
    rows = []
    variants = {"fp32": None, **quant_variants()}
    if bad := set(a.formats) - set(variants):
        raise SystemExit(f"--formats: {', '.join(sorted(bad))} not available here; choose from {', '.join(variants)}")
    for ours_fmt in a.formats:
        opts = variants[ours_fmt]
        gguf = f32 if ours_fmt == "fp32" else quantize(bins, f32, LLAMA_QUANT[ours_fmt.split("-")[0]])
        out = export(tdir, ddir, key, a.max_context, opts, base=a.ours_fp32)
        for t in a.threads:
            lb = llama_bench(bins, gguf, t, a.max_new_tokens, depth)
            lp = llama_plain(bins, gguf, pf, a.max_new_tokens, t, a.max_context)
            og = ours_generate(out, prompt, a.max_new_tokens, t, draft=False)
            rows.append({
                "model": f"qwen3-0.6b-shape L{a.layers}", "format": f"{ours_fmt} / {gguf.stem.split('-')[-1].upper()}",
                "threads": t,
                "llama": {"bench_tok_s": lb["tok_s"], "plain_tok_s": lp["tok_s"], "plain_ms_per_token": lp["ms_per_token"],
                          "bench_ms_per_token": lb["ms_per_token"], "rss_mb_plain": lp["rss_mb"],
                          "file_mb": gguf.stat().st_size / 1e6},
                "ours": {"plain_tok_s": og["tokens_per_second"], "ms_per_call": {"step": og["ms_per_token"]},
                         "rss_mb": og["rss_mb"], "file_mb": dir_mb(out), "options": opts or []},
            })
    shutil.rmtree(pf.parent)
    return rows


def goals(rows: list[dict]) -> list[dict]:
    """The issue's goals, each with the measured ratio."""
    res = []
    for r in rows:
        L, O, t = r["llama"], r["ours"], r["threads"]
        if r["model"] == "demo":
            best = max(L["bench_tok_s"], L["plain_tok_s"], L["dflash_tok_s"])
            need = 1.3 if t == 1 else 1.0
            ratio = O["spec_tok_s"] / best
            res.append({"goal": f"demo, {t} thread(s): our speculative tok/s >= {need}x llama.cpp's best mode",
                        "ratio": ratio, "met": ratio >= need})
        elif t == 2 and r["format"].startswith("int4"):
            step = min(L["plain_ms_per_token"], L["bench_ms_per_token"])
            ratio = O["ms_per_call"]["step"] / step
            res.append({"goal": "0.6B shape, 2 threads: our int4 plain step <= llama.cpp Q4_0's", "ratio": ratio,
                        "met": ratio <= 1.0})
        if r["model"] != "demo" and t == max(x["threads"] for x in rows):
            ratio = O["rss_mb"] / L["rss_mb_plain"]
            res.append({"goal": f"0.6B shape, {r['format']}: our peak RSS <= 1.2x llama.cpp's", "ratio": ratio,
                        "met": ratio <= 1.2})
    return res


def print_table(rows: list[dict], gl: list[dict], meta: dict) -> None:
    print(f"llama.cpp {meta['llamacpp']} vs dflash-export {meta['ours']}; {meta['max_new_tokens']} new tokens, "
          f"greedy; tok/s = decode rate (prefill excluded)")
    hdr = ("model", "format", "thr", "llama bench", "llama plain", "llama DFlash", "ours plain", "ours spec",
           "ms/tok llama|ours", "RSS MB llama|ours", "files MB llama|ours")
    lines = [hdr]
    for r in rows:
        L, O = r["llama"], r["ours"]
        lines.append((
            r["model"], r["format"], str(r["threads"]), f"{L['bench_tok_s']:.0f}", f"{L['plain_tok_s']:.0f}",
            f"{L['dflash_tok_s']:.0f} (tau {L['dflash_tau']:.2f})" if "dflash_tok_s" in L else "-",
            f"{O['plain_tok_s']:.0f}", f"{O['spec_tok_s']:.0f} (tau {O['tau']:.2f})" if "spec_tok_s" in O else "-",
            f"{L['plain_ms_per_token']:.2f} | {O['ms_per_call']['step']:.2f}",
            f"{max(L['rss_mb_plain'], L.get('rss_mb_dflash', 0)):.0f} | {O['rss_mb']:.0f}",
            f"{L['file_mb']:.1f} | {O['file_mb']:.1f}"))
    widths = [max(len(x[i]) for x in lines) for i in range(len(hdr))]
    for ln in lines:
        print("  ".join(c.ljust(w) for c, w in zip(ln, widths)).rstrip())
    for r in rows:
        if "plain_output_vs_ours" in r:
            print(f"{r['model']} {r['threads']} thr: prompt tokens identical {r['prompt_tokens_identical']}; "
                  f"llama plain vs ours {r['plain_output_vs_ours']}; llama DFlash vs ours {r['dflash_output_vs_ours']}; "
                  f"ours lossless {r['ours']['lossless']}")
    for g in gl:
        print(f"{'MET    ' if g['met'] else 'NOT MET'} {g['goal']}: {g['ratio']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo,qwen3-0.6b", help="comma-separated: demo, qwen3-0.6b")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, same on both sides")
    ap.add_argument("--prompts", type=int, default=3, help="demo/prompts.jsonl prompts (demo model)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--formats", default="fp32,int8,int4",
                    help="qwen3-0.6b: ours vs llama.cpp formats, of fp32, int8, int4, int8-acc4, int4-acc4 "
                         "(int8 -> Q8_0, int4 -> Q4_0; -acc4 = --quant-accuracy-level 4)")
    ap.add_argument("--ours-fp32", type=Path, default=None,
                    help="qwen3-0.6b: an existing fp32 export of the same random checkpoint (in the cache), used and "
                         "quantized instead of re-exporting (export takes long on a loaded 2-vCPU machine)")
    ap.add_argument("--layers", type=int, default=28, help="depth of the Qwen3-0.6B shape (28 = the real one)")
    ap.add_argument("--max-context", type=int, default=2048, help="KV capacity, both sides (llama -c)")
    ap.add_argument("--n-max", type=int, default=15, help="llama.cpp --spec-draft-n-max (DFlash block 16 = 15 drafts)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="demo: our draft_block's K (export --block-size) [default: the drafter's, 16]")
    ap.add_argument("--attention", default="standard", choices=["standard", "ort"],
                    help="demo: our export's attention flavour (export --attention)")
    ap.add_argument("--calibrate", action="store_true",
                    help="demo: `bench --calibrate` our export once (runtime.json: adaptive verify, on bench's "
                         "built-in prompts, not the measured ones); without it ours verifies the full block")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.threads = [int(x) for x in a.threads.split(",")]
    a.formats = a.formats.split(",")
    models = a.model.split(",")
    if bad := set(models) - {"demo", "qwen3-0.6b"}:
        raise SystemExit(f"--model: unknown {', '.join(sorted(bad))}; choose demo and/or qwen3-0.6b")
    src, bins = build_llamacpp()
    rows = []
    if "demo" in models:
        rows += compare_demo(src, bins, a)
    if "qwen3-0.6b" in models:
        rows += compare_06b(src, bins, a)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    meta = {"llamacpp": f"{llama_commit()} (llama-cpp-python {VERSION} sdist)", "ours": head.strip(),
            "max_new_tokens": a.max_new_tokens, "threads": a.threads, "cpu_count": os.cpu_count(),
            "attention": a.attention, "block_size": a.block_size, "calibrated": a.calibrate, "loadavg": os.getloadavg()}
    gl = goals(rows)
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows, "goals": gl}))
    else:
        print_table(rows, gl, meta)


if __name__ == "__main__":
    main()
