"""llama.cpp for the peer benchmarks (bench/vs_llamacpp.py, bench/vs_llamaserver.py): its source, build,
converter and tools, each run as a process whose own peak RSS is read.

llama.cpp is built from the source that the llama-cpp-python 0.3.36 sdist vendors (pip download,
cmake Release with BUILD_FLAGS, -j2; cached under ~/.cache/dflash-export/llamacpp, or
DFLASH_LLAMACPP_CACHE), checkpoints are converted with its own convert_hf_to_gguf.py and quantized
with llama-quantize.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

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
LLAMA_QUANT = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_0"}  # our format -> the llama.cpp format it is compared with
# Not GGML_NATIVE: these VMs' CPUs advertise AMX, whose instructions fault here ("Illegal instruction" on
# Q8_0 with a native build); every other x86 extension they have, spelled out.
BUILD_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
               "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


@dataclass
class Run:
    out: str
    err: str
    rss_mb: float
    wall_s: float


# Peak RSS of one process, read as ru_maxrss of a launcher's only child. Not wait4 on a child of this
# process: on Linux a forked child starts with its parent's RSS high-water mark (exec records the old
# address space's peak), so every tool run after this process held a 3 GB checkpoint read 3 GB. The
# launcher is a fresh interpreter (about 10 MB, the floor of what this reports).
LAUNCH = r"""
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, ru = os.wait4(pid, 0)
with open(os.environ["VS_LLAMACPP_RSS"], "w") as f:
    f.write(str(ru.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run(cmd: list, env: dict | None = None, nice: bool = False) -> Run:
    """Run a process to completion: its output, wall time and its own peak RSS (LAUNCH)."""
    name, cmd = Path(str(cmd[0])).name, (["nice", "-n", "19"] if nice else []) + [str(c) for c in cmd]
    env = dict(env or os.environ)
    if name.startswith("llama-"):
        # llama.cpp's CPU backend is built with OpenMP: OMP_WAIT_POLICY=PASSIVE (which these benches'
        # commands set for PyTorch's sake) puts its threads to sleep at every per-op barrier, which
        # measured 207 against 1,003 tok/s at 2 threads vs 1 on the demo pair. llama.cpp runs with
        # its own default.
        env.pop("OMP_WAIT_POLICY", None)
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe, tempfile.NamedTemporaryFile() as rss:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", LAUNCH, *cmd], stdout=fo, stderr=fe,
                           env=dict(env, VS_LLAMACPP_RSS=rss.name))
        wall = time.perf_counter() - t
        fo.seek(0), fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
        kib = Path(rss.name).read_text().strip()
    if p.returncode != 0:
        tail = [ln for ln in (err + out).splitlines() if ln.strip()][-3:]
        raise SystemExit(f"{name} failed (exit {p.returncode}): " + " | ".join(tail))
    return Run(out, err, int(kib or 0) / 1024, wall)


def run_logged(cmd: list, pattern: str, tries: int = 6) -> Run:
    """Run a llama.cpp tool until its stderr has `pattern`: its logger is an async thread, and seen here
    under load, a process sometimes exits before the thread has written the last lines (perf, stats)."""
    for _ in range(tries):
        r = run(cmd)
        if re.search(pattern, r.err):
            return r
    raise SystemExit(f"{Path(str(cmd[0])).name}: no {pattern!r} in its log after {tries} runs")


# -- llama.cpp: source, build, conversion ------------------------------------------------------


def build_llamacpp(jobs: int = max(2, os.cpu_count() or 2)) -> tuple[Path, Path]:
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
        print(f"building llama.cpp (Release, {' '.join(BUILD_FLAGS)}, -j{jobs}; tens of minutes on 2 cores, minutes on 16)", file=sys.stderr)
        run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", *BUILD_FLAGS,
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_APP=OFF"], nice=True)
        run(["cmake", "--build", build, f"-j{jobs}", "--target", *BINARIES], nice=True)
    else:
        have = build_flags()
        if not set(BUILD_FLAGS) <= set(have):
            raise SystemExit(f"{build} was configured with {' '.join(have)}, not {' '.join(BUILD_FLAGS)}: remove it to rebuild")
    return src, bins


def build_flags() -> list[str]:
    """The GGML instruction-set options the cached build was configured with (-DNAME=ON|OFF)."""
    text = (CACHE / "build" / "CMakeCache.txt").read_text()
    return [f"-D{k}={v}" for k, v in re.findall(r"^(GGML_(?:NATIVE|AVX\w*|AMX\w*|FMA|F16C|BMI2)):BOOL=(\w+)$", text, re.M)]


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


def llama_bench(bins: Path, gguf: Path, threads: int, prompt: int = 0, n: int = 0, depth: int = 0, reps: int = 1) -> dict:
    """llama-bench: pp`prompt` (a prompt of that many tokens) or tg`n` (n tokens generated at context
    depth `depth`), the mean of `reps` repetitions, its process's peak RSS."""
    r = run([bins / "llama-bench", "-m", gguf, "-t", threads, "-p", prompt, "-n", n, "-d", depth, "-r", reps, "-o", "json"])
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
