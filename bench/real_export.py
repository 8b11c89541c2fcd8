"""Exports at real size inside a memory limit: dflash-export against llama.cpp's convert + quantize.

    flock /work/bigmem.lock nice -n 10 .venv/bin/python bench/real_export.py \
        --target /work/ckpt/Qwen3-8B --draft /work/ckpt/Qwen3-8B-DFlash-b16 --out /work/ckpt/out --limit 16G \
        --runs int4,llama-q4_0,fp32

Each run is one child process in a fresh memory cgroup of its own (v1 or v2, whichever this
machine has; swap off in it: no swap may hide memory) with the limit given, sampled twice a
second: the cgroup's anonymous memory (v1 memory.stat total_rss, v2 anon: what the process
holds, not the page cache its reads and writes leave), its peak total (page cache included)
and the bytes of the run's outputs and staging folders on disk (`extra disk`, the most there
at any moment). Runs:

- int4: `dflash-export export --attention ort --quantize int4` (the issue's command);
- fp32: `dflash-export export --attention ort` (the float artifact; removed after measuring);
- llama-q4_0: llama.cpp's `convert_hf_to_gguf.py --outtype bf16` then `llama-quantize Q4_0`
  (bench/llamacpp.py's build and launcher; the bf16 GGUF is removed once quantized).

The target needs a tokenizer for llama.cpp's converter (bench/real_checkpoint.py puts the
demo's beside it). Prints a line per run, and last the JSON row list.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V1 = Path("/sys/fs/cgroup/memory")


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


class Cgroup:
    """A memory cgroup of its own for one child (v1 when the memory controller is mounted there, else v2)."""

    def __init__(self, name: str, limit: int):
        self.v1 = (V1 / "memory.limit_in_bytes").is_file()
        self.dir = (V1 if self.v1 else Path("/sys/fs/cgroup")) / name
        self.dir.mkdir(exist_ok=True)
        if self.v1:
            (self.dir / "memory.limit_in_bytes").write_text(str(limit))
            try:
                (self.dir / "memory.memsw.limit_in_bytes").write_text(str(limit))  # memory + swap: no swap
            except OSError:
                pass
            (self.dir / "memory.swappiness").write_text("0")
        else:
            (self.dir / "memory.max").write_text(str(limit))
            (self.dir / "memory.swap.max").write_text("0")

    def stat(self) -> dict[str, int]:
        out = {}
        for line in (self.dir / "memory.stat").read_text().splitlines():
            k, v = line.split()
            out[k] = int(v)
        return out

    def anon(self) -> int:
        s = self.stat()
        return s["total_rss"] if self.v1 else s["anon"]

    def peak(self) -> int:
        f = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        try:
            return int((self.dir / f).read_text())
        except OSError:
            return -1

    def oom_kills(self) -> int:
        if self.v1:
            return int("oom_kill 1" in (self.dir / "memory.oom_control").read_text())
        for line in (self.dir / "memory.events").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass


def tree_bytes(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            for root, _, files in os.walk(p):
                for f in files:
                    try:
                        total += os.stat(os.path.join(root, f)).st_size
                    except OSError:
                        pass
    return total


def measured(cmds: list[list[str]], limit: int, disk_of, name: str) -> dict:
    """Run `cmds` one after another, each in the cgroup (the shell joins it, then execs), sampling."""
    cg = Cgroup(f"dflash-{name}-{os.getpid()}", limit)
    peak_anon, peak_disk, rc, t0 = 0, 0, 0, time.perf_counter()
    stop = threading.Event()

    def sample():
        nonlocal peak_anon, peak_disk
        while not stop.is_set():
            try:
                peak_anon = max(peak_anon, cg.anon())
            except (OSError, KeyError):
                pass
            peak_disk = max(peak_disk, tree_bytes(disk_of()))
            stop.wait(0.5)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    log = []
    try:
        for cmd in cmds:
            join = f'echo $$ > {cg.dir}/cgroup.procs && exec "$@"'
            p = subprocess.run(["sh", "-c", join, "sh", *cmd], capture_output=True, text=True)
            log.append((p.stdout + p.stderr)[-2000:])
            rc = p.returncode
            if rc:
                break
    finally:
        stop.set()
        th.join()
    wall = time.perf_counter() - t0
    row = {"run": name, "rc": rc, "wall_s": round(wall, 1), "peak_anon_gb": round(peak_anon / 1e9, 2),
           "peak_cgroup_gb": round(cg.peak() / 1e9, 2), "oom_killed": cg.oom_kills(),
           "peak_disk_gb": round(peak_disk / 1e9, 2), "limit_gb": round(limit / 2**30, 1)}
    if rc:
        row["error"] = log[-1][-600:]
    cg.remove()
    return row


def siblings(out: Path) -> list[Path]:
    return [out, *out.parent.glob(f".{out.name}.*")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for the artifacts and GGUF files")
    ap.add_argument("--limit", default="16G", help="the memory cgroup's limit")
    ap.add_argument("--runs", default="int4,llama-q4_0,fp32")
    ap.add_argument("--mask-token-id", default="151669")
    ap.add_argument("--keep", action="store_true", help="keep the fp32 artifact (large)")
    a = ap.parse_args()
    limit, rows = parse_size(a.limit), []
    a.out.mkdir(parents=True, exist_ok=True)
    exe = str(Path(sys.executable).with_name("dflash-export"))
    common = ["--target", str(a.target), "--draft", str(a.draft), "--mask-token-id", a.mask_token_id, "--force"]
    ckpt = tree_bytes([a.target]) + tree_bytes([a.draft])
    for run in a.runs.split(","):
        load0 = os.getloadavg()[0]
        if run in ("int4", "fp32"):
            out = a.out / f"{a.target.name}-{run}"
            extra = ["--quantize", "int4"] if run == "int4" else []
            row = measured([[exe, "export", *common, "--out", str(out), "--attention", "ort", *extra]], limit,
                           lambda out=out: siblings(out), run)
            row["artifact_gb"] = round(tree_bytes([out]) / 1e9, 2) if out.is_dir() else None
            row["command"] = f"dflash-export export --attention ort {' '.join(extra)}".strip()
            if run == "fp32" and not a.keep:
                shutil.rmtree(out, ignore_errors=True)
        elif run == "llama-q4_0":
            sys.path.insert(0, str(ROOT / "bench"))
            import llamacpp as L

            src, bins = L.CACHE / f"llama_cpp_python-{L.VERSION}" / "vendor" / "llama.cpp", L.CACHE / "build" / "bin"
            bf16, q4 = a.out / f"{a.target.name}-bf16.gguf", a.out / f"{a.target.name}-q4_0.gguf"
            env_py = f"PYTHONPATH={L.converter_deps()}"
            convert = ["env", env_py, "OMP_NUM_THREADS=2", sys.executable, "-c", L.CONVERT, str(src), L.PRE_TOKENIZER,
                       str(a.target), "--outfile", str(bf16), "--outtype", "bf16"]
            quant = [str(bins / "llama-quantize"), str(bf16), str(q4), "Q4_0", "2"]
            t0 = time.perf_counter()
            row = measured([convert], limit, lambda: [bf16], "llama-convert-bf16")
            row["command"] = "convert_hf_to_gguf.py --outtype bf16"
            rows.append(row | {"load_1m": round(load0, 1)})
            print(json.dumps(rows[-1]), flush=True)
            row = measured([quant], limit, lambda: [bf16, q4], "llama-quantize-q4_0")
            row["command"] = "llama-quantize Q4_0 (2 threads)"
            row["artifact_gb"] = round(q4.stat().st_size / 1e9, 2) if q4.is_file() else None
            row["convert_plus_quantize_s"] = round(time.perf_counter() - t0, 1)
            row["llama_cpp"] = L.llama_commit()
            bf16.unlink(missing_ok=True)
        else:
            raise SystemExit(f"unknown run {run!r}")
        row |= {"target": str(a.target), "draft": str(a.draft), "checkpoint_gb": round(ckpt / 1e9, 2),
                "load_1m": round(load0, 1), "load_1m_after": round(os.getloadavg()[0], 1),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, {round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)} GiB",
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
