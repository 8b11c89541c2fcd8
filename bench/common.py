"""The bench suite's harness: what every script shares.

- `parser(__doc__, out=...)`: the command line, the docstring as its help, the shared options
  (`--json`, and `--out` for scripts that write a report, into bench/results/ by default).
- `machine()`: the record every figure needs beside it (CPU model, cores, load average,
  software versions, date, commit); `report(...)` starts a report with it, `write_report`
  adds the load after and writes the JSON.
- `interleaved(calls, passes)`: each call once per pass, in turn, so the machine's drift
  falls on every side alike (the figures to compare are ratios within one run).
- Benchmark models: small but not microscopic, random weights, built with
  dflash_export.models.tiny's writers (a Hugging Face Qwen3 checkpoint and a z-lab drafter), then
  exported with export_artifact; cached under DFLASH_BENCH_CACHE (default
  ~/.cache/dflash-export/bench) by their parameters and the exporter/model/contract sources.
  Real-shape checkpoints (random weights at a released model's shape, written shard by shard
  without building a model) come from `make_checkpoint`.
- Steps whose peak RSS is measured run in a child process of their own (`run_child`), read
  with `peak_rss_bytes` / `mem`.
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
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"  # reports the scripts write by default (bench/results/README.md)
SOFTWARE = ("onnxruntime", "numpy", "torch", "transformers", "tensorrt")  # versions a report records, where installed
BENCH_MODELS = {
    # the shipped demo pair's shape (demo/), random weights
    "small": dict(arch="qwen3", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768,
                  vocab=4096, draft_layers=1, block=16, max_context=2304),
    # wider and with a 32k vocabulary: the LM head dominates every call on CPU
    "wide": dict(arch="qwen3", layers=6, hidden=384, heads=6, kv_heads=2, head_dim=64, intermediate=1024,
                 vocab=32000, draft_layers=2, block=16, max_context=2304),
    # hidden 1024 (Qwen3-0.6B's width and head layout, 4 layers, small vocab): wide enough that the
    # attention flavours' context cost shows as it does at real sizes
    "h1024": dict(arch="qwen3", layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=64, intermediate=3072,
                  vocab=4096, draft_layers=1, block=16, max_context=2304),
}


def bench_model(name: str = "small", attention: str = "standard") -> tuple[Path, Path, Path]:
    """(target_dir, draft_dir, exported_dir) of the named benchmark pair (export --attention)."""
    if name not in BENCH_MODELS:
        raise SystemExit(f"unknown bench model {name!r}; choose one of {', '.join(BENCH_MODELS)}")
    p = BENCH_MODELS[name]

    def build(t: Path, d: Path) -> None:
        from dflash_export.models.tiny import make_drafter, make_target

        make_target(t, p["arch"], vocab=p["vocab"], hidden=p["hidden"], layers=p["layers"], heads=p["heads"],
                    kv_heads=p["kv_heads"], head_dim=p["head_dim"], intermediate=p["intermediate"], std=0.04)
        make_drafter(d, t, layers=p["draft_layers"], block_size=p["block"])

    final = cached_export(f"{p['arch']}-L{p['layers']}-H{p['hidden']}", p, build, p["max_context"], attention)
    return final / "t", final / "d", final / "out"


def cached_export(name: str, spec: dict, build, max_context: int, attention: str = "standard") -> Path:
    """A folder with t/, d/ (the random pair `build(t, d)` writes) and out/ (their export),
    made once: cached under DFLASH_BENCH_CACHE by `spec` and the sources an export depends on."""
    key = hashlib.sha256((json.dumps(spec, sort_keys=True) + source_digest()).encode()).hexdigest()[:12]
    final = cache_dir() / (f"{name}-{key}" + ("-ort" if attention == "ort" else ""))
    if not (final / "out" / "manifest.json").is_file():
        from dflash_export.export.artifact import export_artifact

        tmp = final.parent / f".{final.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp / "t", tmp / "d")
        export_artifact(tmp / "t", tmp / "d", tmp / "out", max_context=max_context, attention=attention, progress=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    return final


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_BENCH_CACHE", Path.home() / ".cache/dflash-export/bench"))


def source_digest() -> str:
    """Hash of what an export depends on (exporter, reference models, contract): a change re-exports."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "export").glob("*.py")) + sorted((ROOT / "models").glob("*.py")) + [ROOT / "runtime/contract.py"]:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def export_pair(target_dir: str | Path, draft_dir: str | Path, max_context: int = 2304) -> Path:
    """Export a given (e.g. trained) pair once; cached by the content of both directories."""
    from dflash_export.runtime.manifest import hash_files

    key = hashlib.sha256(json.dumps([hash_files(Path(target_dir)), hash_files(Path(draft_dir)), max_context,
                                     source_digest()], sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / f"pair-{key}"
    if not (out / "manifest.json").is_file():
        from dflash_export.export.artifact import export_artifact

        export_artifact(target_dir, draft_dir, out, max_context=max_context, progress=True, force=True)
    return out


def head_nodes(exported: Path) -> set[str]:
    """Names of the target graph's nodes that read the LM head (to set its kernels apart in a profile)."""
    import onnx

    g = onnx.load(str(exported / "target.onnx"), load_external_data=False).graph
    return {n.name for n in g.node if any(i.startswith("lm_head.weight") for i in n.input)}


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it does not carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def mem() -> dict:
    """VmRSS / VmHWM / RssAnon / RssFile of this process in MB (Linux /proc)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = round(int(val.split()[0]) / 1024)
    return out


def make_checkpoint(work: Path, vocab: int, hidden: int, layers: int, inter: int, heads: int | None = None,
                    kv_heads: int | None = None, tie: bool = False, config: dict | None = None,
                    drafter: dict | None = None) -> None:
    """Random fp32 Qwen3 target (head_dim 128) + 1-layer drafter under work/target, work/draft
    (`config`: config.json entries to override; `drafter`: new_drafter's keywords to override)."""
    import torch
    from safetensors.torch import save_file

    from dflash_export.models import TargetConfig, new_drafter

    heads, kv_heads, head_dim = heads or hidden // 128, kv_heads or max(1, hidden // 256), 128
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 4096, "tie_word_embeddings": tie, "eos_token_id": vocab - 1, "dtype": "float32",
    } | (config or {})
    t = work / "target"
    t.mkdir(parents=True)
    (t / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    weight_map = {}

    def shard(name: str, tensors: dict) -> None:  # one tensor group at a time: small writer RSS
        save_file(tensors, str(t / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(vocab, hidden)})
    head = {} if tie else {"lm_head.weight": rand(vocab, hidden)}
    shard("head.safetensors", {**head, "model.norm.weight": torch.ones(hidden)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(f"layer{i}.safetensors", {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim), p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    (t / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tc = TargetConfig.load(t)
    kw = dict(num_layers=1, block_size=16, mask_token_id=vocab - 2, target_layer_ids=[layers // 2], intermediate_size=hidden * 2)
    new_drafter(tc, **kw | (drafter or {})).save_pretrained(work / "draft")


def run_child(script: str, args: list[str]) -> dict:
    """`python script args` in a process of its own (its own peak RSS); its last stdout line is JSON."""
    done = subprocess.run([sys.executable, script, *args], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 2, length).tolist() for _ in range(n)]


def uptime() -> str:
    """The load beside every figure: the machines are shared."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def parser(doc: str, out: str | None = None, json_flag: bool = True) -> argparse.ArgumentParser:
    """A script's command line: its docstring as the help, `--json` (one JSON report on stdout) and,
    given `out`, `--out PATH` (the report's file, default bench/results/OUT)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if json_flag:
        ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    if out:
        ap.add_argument("--out", type=Path, default=RESULTS / out, help=f"the JSON report [default: bench/results/{out}]")
    return ap


def machine() -> dict:
    """What a figure needs beside it: the CPU, its cores, the load, the software, the date, the commit.
    Versions are read from the installed packages' metadata, so nothing heavy is imported."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor() or platform.machine())
    flags = next((ln.split(":", 1)[1].split() for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("flags")), [])
    versions = {"python": platform.python_version()}
    for name in SOFTWARE:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu,
            "simd": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags],
            "cores": len(os.sched_getaffinity(0)), "load": [round(x, 2) for x in os.getloadavg()], "os": platform.platform(),
            "software": versions, "commit": commit.stdout.strip() or None}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def report(**fields) -> dict:
    """A report's start: the machine record, the load before, then the script's own fields."""
    return {"machine": machine(), "load_before": uptime(), **fields}


def interleaved(calls: dict[str, Callable[[], object]], passes: int) -> dict[str, list[float]]:
    """Each call once per pass, in turn: {name: [seconds of each pass]} (take the min or the median)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(passes):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return times


def write_report(report: dict, out: Path, ratios=None) -> None:
    """The load after (and the ratios over the runs, given a function of them), printed and written as JSON."""
    report.setdefault("machine", machine())
    report["load_after"] = uptime()
    if ratios is not None:
        report["ratios"] = ratios(report["runs"])
        print(json.dumps(report["ratios"], indent=1))
    print(report["load_after"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
