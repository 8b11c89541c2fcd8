"""Server against server: `dflash-export serve --max-batch N` vs `llama-server -np N`, same weights, same client.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/vs_llamaserver.py --concurrency 1,2,4 --max-tokens 64 \\
        --repeats 2 --formats f32,q4_0 --out bench/results/vs_llamaserver.json

llama.cpp is the build of bench/vs_llamacpp.py (the llama-cpp-python 0.3.36 sdist's vendored
source, with llama-server among its BINARIES; cached), the demo pair converted with its own
converter (F32) and quantized with llama-quantize (Q4_0, against our int4 weights at accuracy
level 4, the fast CPU path of ONNX Runtime's MatMulNBits). Servers, all on 127.0.0.1 with an
ephemeral port, started once and stopped by their pid:

  ours           dflash-export serve ART --max-batch N (speculative, and `speculative: false` per request)
  llama plain    llama-server -m TARGET.gguf -np N -c N x context
  llama DFlash   llama-server ... -md DRAFT.gguf --spec-type draft-dflash --spec-draft-n-max 15 (its DFlash mode)

The client is the same for every server: c concurrent streamed greedy `/v1/completions` (the
first c demo prompts as text, `cache_prompt: false`, `stream_options.include_usage`), timed
from the first request's start to the last one's end. Per run: the aggregate tokens/s (every
completion token over that wall time, prefills included, the same prompts on every side) and
the mean time to first token. For each concurrency the servers run in turn, --repeats times
(ours spec, ours plain, llama plain, llama DFlash, then the next c, then again ...): the best run
of each is reported, and the median over repeats of our best mode over theirs in that repeat;
the texts of every side are compared with ours (identical weights and greedy: they should be
the same text). `uptime` is recorded before and after.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vs_llamacpp as vl  # noqa: E402 (the build, the converter, our exports)
from common import machine, parser, uptime, write_report  # noqa: E402

ROOT = vl.ROOT


class Proc:
    """A server process on 127.0.0.1, port 0; its port read from its output; stopped by its pid."""

    def __init__(self, name: str, cmd: list, pattern: str, env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env)
        self.log: list[str] = []
        deadline = time.monotonic() + 600
        self.port = None
        for line in self.proc.stdout:  # ends when the process exits
            self.log.append(line)
            if m := re.search(pattern, line):
                self.port = int(m.group(1))
                break
            if time.monotonic() > deadline:
                break
        if self.port is None:
            self.stop()
            raise SystemExit(f"{name} did not start (exit {self.proc.returncode}): {''.join(self.log[-3:])}")
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout], daemon=True).start()
        while True:  # llama-server answers 503 while it loads the model; ours prints ready when loaded
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} is not healthy: {''.join(self.log[-5:])}")
            time.sleep(0.2)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", path)
        r = conn.getresponse()
        out = r.status, r.read()
        conn.close()
        return out

    def complete(self, prompt: str, max_tokens: int, extra: dict) -> dict:
        """One streamed greedy completion: text, completion tokens (usage), TTFT, wall time."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_prompt": False,
                "stream_options": {"include_usage": True}, **extra}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"{self.name}: HTTP {r.status}: {r.read()[:300]!r}")
        text, usage, ttft = [], None, None
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            c = json.loads(line[6:])
            if c.get("choices"):
                piece = c["choices"][0].get("text") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
            usage = c.get("usage") or usage
        conn.close()
        if usage is None:
            raise SystemExit(f"{self.name}: no usage in the stream")
        return {"text": "".join(text), "tokens": usage["completion_tokens"], "ttft": ttft or float("nan"),
                "wall": time.perf_counter() - t0}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def load(server: Proc, prompts: list[str], max_tokens: int, extra: dict) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        rs = list(pool.map(lambda p: server.complete(p, max_tokens, extra), prompts))
    wall = time.perf_counter() - t0
    n = sum(r["tokens"] for r in rs)
    return {"tokens_per_s": n / wall, "tokens": n, "wall_s": wall,
            "ttft_ms_mean": 1e3 * sum(r["ttft"] for r in rs) / len(rs), "texts": [r["text"] for r in rs]}


def servers(a, fmt: str, src: Path, bins: Path, out: dict) -> None:
    """The three servers on one format's weights, into `out` as each starts (the caller stops
    them, also those started before one failed to)."""
    tdir, ddir = ROOT / "demo" / "pair" / "target", ROOT / "demo" / "pair" / "draft"
    gdir = vl.CACHE / "gguf" / "demo"
    tg, dg = vl.convert(src, tdir, gdir / "target-f32.gguf"), vl.convert(src, ddir, gdir / "draft-f32.gguf", tdir)
    key = __import__("hashlib").sha256((tdir / "model.safetensors").read_bytes()
                                       + (ddir / "model.safetensors").read_bytes()).hexdigest()
    art = vl.export(tdir, ddir, key, a.max_context, attention=a.attention)
    if fmt != "f32":
        tg, dg = vl.quantize(bins, tg, fmt.upper()), vl.quantize(bins, dg, fmt.upper())
        art = vl.export(tdir, ddir, key, a.max_context, OURS_QUANT[fmt], base=art)
    if a.calibrate and not (art / "runtime.json").is_file():
        print(f"calibrating {art}", file=sys.stderr)
        vl.run([*vl.cli(), "bench", art, "--calibrate", "--max-new-tokens", a.max_tokens, "--json"])
    N, t = max(a.concurrency), a.threads
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out["ours"] = Proc("ours", [*vl.cli(), "serve", art, "--port", 0, "--max-batch", N, "--max-queue", 64,
                                 "--threads", t], r"ready at http://127\.0\.0\.1:(\d+)", env)
    llama = [bins / "llama-server", "-m", tg, "-np", N, "-c", N * a.max_context, "-t", t, "--host", "127.0.0.1",
             "--port", 0, "--no-webui", *(["-fa", "off"] if a.no_flash_attn else [])]
    listening = r"listening on http://127\.0\.0\.1:(\d+)"
    out["llama_plain"] = Proc("llama-server", llama, listening)
    out["llama_dflash"] = Proc("llama-server DFlash", [*llama, "-md", dg, "--spec-type", "draft-dflash",
                                                       "--spec-draft-n-max", a.n_max, "-td", t], listening)


OURS_QUANT = {  # llama.cpp's format (target and drafter quantized by llama-quantize) -> ours: the same weights
    q: ["--quantize", ours, "--quantize-draft", "--quantize-lm-head", "--quant-accuracy-level", "4"]
    for q, ours in (("q4_0", "int4"), ("q8_0", "int8"))}
MODES = {"ours_spec": ("ours", {"speculative": True}), "ours_plain": ("ours", {"speculative": False}),
         "llama_plain": ("llama_plain", {}), "llama_dflash": ("llama_dflash", {})}


def main() -> None:
    ap = parser(__doc__, out="vs_llamaserver.json", json_flag=False)
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--formats", default="f32",
                    help="comma-separated: f32, q4_0, q8_0 (ours: fp32, int4, int8 weights at accuracy level 4)")
    ap.add_argument("--threads", type=int, default=1, help="per call, both sides (ours --threads, llama -t/-td)")
    ap.add_argument("--max-context", type=int, default=2048, help="per request, both sides")
    ap.add_argument("--attention", default="standard", choices=["standard", "ort"],
                    help="our export's attention flavour (standard: as serve --demo; ort verifies one row a call)")
    ap.add_argument("--calibrate", action="store_true", help="`bench --calibrate` our export once (runtime.json)")
    ap.add_argument("--n-max", type=int, default=15, help="llama-server --spec-draft-n-max")
    ap.add_argument("--no-flash-attn", action="store_true", help="llama-server -fa off")
    a = ap.parse_args()
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    src, bins = vl.build_llamacpp()
    prompts = vl.demo_prompts(max(a.concurrency))
    report = {"llamacpp": f"{vl.llama_commit()} (llama-cpp-python {vl.VERSION} sdist)", "threads": a.threads,
              "max_tokens": a.max_tokens, "concurrency": a.concurrency, "attention": a.attention,
              "machine": machine(), "load_before": uptime(), "runs": []}
    print(report["load_before"], flush=True)
    for fmt in a.formats.split(","):
        procs: dict = {}
        try:
            servers(a, fmt, src, bins, procs)
            for c in a.concurrency:  # warm-up: first calls of each shape
                for name, (srv, extra) in MODES.items():
                    load(procs[srv], prompts[:c], min(16, a.max_tokens), extra)
            got: dict = {}  # (c, mode) -> one run per repeat; each repeat runs every c on every mode in turn
            for _ in range(a.repeats):
                for c in a.concurrency:
                    for name, (srv, extra) in MODES.items():
                        got.setdefault((c, name), []).append(load(procs[srv], prompts[:c], a.max_tokens, extra))
            for c in a.concurrency:
                ours_text = got[c, "ours_spec"][0]["texts"]
                per_repeat = [max(got[c, m][i]["tokens_per_s"] for m in ("ours_spec", "ours_plain"))
                              / max(got[c, m][i]["tokens_per_s"] for m in ("llama_plain", "llama_dflash"))
                              for i in range(a.repeats)]
                for name in MODES:
                    r = max(got[c, name], key=lambda x: x["tokens_per_s"])
                    row = {"format": fmt, "mode": name, "concurrency": c,
                           "same_text_as_ours": all(x["texts"] == ours_text for x in got[c, name]),
                           **{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items() if k != "texts"}}
                    if name == "ours_spec":
                        row["ours_best_over_llama_best_median"] = round(sorted(per_repeat)[len(per_repeat) // 2], 3)
                    report["runs"].append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for p in procs.values():
                p.stop()
    write_report(report, a.out, ratios)


def ratios(runs: list[dict]) -> dict:
    """Per format and concurrency: our best mode over llama-server's best mode; each mode at c over its c = 1."""
    out = {}
    at = {(r["format"], r["mode"], r["concurrency"]): r["tokens_per_s"] for r in runs}
    for fmt, c in sorted({(f, c) for f, _, c in at}):
        ours = max(at[fmt, m, c] for m in ("ours_spec", "ours_plain"))
        theirs = max(at[fmt, m, c] for m in ("llama_plain", "llama_dflash"))
        out[f"{fmt} c{c}: ours best / llama-server best"] = round(ours / theirs, 2)
        spec = next(r for r in runs if (r["format"], r["mode"], r["concurrency"]) == (fmt, "ours_spec", c))
        out[f"{fmt} c{c}: ours best / llama-server best, median of repeats"] = spec["ours_best_over_llama_best_median"]
        for m in MODES:
            if (fmt, m, 1) in at:
                out[f"{fmt} {m}: c{c} / c1"] = round(at[fmt, m, c] / at[fmt, m, 1], 2)
    return out


if __name__ == "__main__":
    main()
