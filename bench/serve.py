"""Benchmark of `dflash-export serve` on the demo pair (or any exported directory).

    .venv/bin/python bench/serve.py                       # demo pair, writes bench/results/serve.json
    .venv/bin/python bench/serve.py --artifact OUT --prompts 8 --max-tokens 64
    .venv/bin/python bench/serve.py --only-overhead --repeats 6   # just the HTTP-overhead figure, more passes

Measures, with real server processes on 127.0.0.1 and streamed requests (raw HTTP, SSE):
- TTFT, inter-chunk latency (one chunk per accepted round) and TPOT, p50/p99, and aggregate
  tokens/s at concurrency 1, 2, 4, with --slots 1 and 2, speculative vs plain decoding;
- HTTP overhead: concurrency 1 through the server vs the loop in this process (`generate`),
  end-to-end tokens/s of the same requests, interleaved;
- resident memory of the server with 1 vs 4 slots after every slot served a request, next to
  the weights' size and the KV buffers one slot allocates;
- prompt reuse: TTFT of a second turn that extends the first, with and without cache_prompt.
"""

from __future__ import annotations

import argparse
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


class Server:
    def __init__(self, art: Path, *args):
        cmd = [sys.executable, "-c", "from dflash_export.cli import main; main()", "serve", str(art), "--port", "0",
               "--max-queue", "64", *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            if m := re.search(r"ready at http://127\.0\.0\.1:(\d+)", line):
                self.port = int(m.group(1))
                break
        else:
            raise SystemExit("the server did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def post(self, path: str, body: dict) -> dict:
        """One streamed request: arrival time and tokens of every chunk (a round's, for the decode
        window), and the final timings."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", path, json.dumps(body | {"stream": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        arrivals, chunks, timings = [], [], None
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            c = json.loads(line[6:])
            ids = c["choices"][0].get("token_ids", []) if c["choices"] else []
            if ids:
                arrivals.append(time.perf_counter() - t0)
                chunks.append(ids)
            timings = c.get("timings", timings)
        conn.close()
        return {"arrivals": arrivals, "chunks": chunks, "tokens": [t for c in chunks for t in c],
                "total": time.perf_counter() - t0, "timings": timings}

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


def pct(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else float("nan")


def load(server: Server, prompts: list[str], max_tokens: int, concurrency: int, speculative: bool) -> dict:
    body = lambda p: {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "speculative": speculative,  # noqa: E731
                      "cache_prompt": False}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rs = list(pool.map(lambda p: server.post("/v1/completions", body(p)), prompts))
    wall = time.perf_counter() - t0
    ttft = [r["arrivals"][0] for r in rs]
    gaps = [b - a for r in rs for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tpot = [(r["total"] - r["arrivals"][0]) / (len(r["tokens"]) - 1) for r in rs if len(r["tokens"]) > 1]
    n = sum(len(r["tokens"]) for r in rs)
    return {"requests": len(rs), "tokens": n, "wall_s": wall, "tokens_per_s": n / wall,
            "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
            "inter_chunk_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99)},
            "tpot_ms": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
            "outputs": [r["tokens"] for r in rs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, help="exported directory [default: the demo pair, exported once]")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, help="[default: bench/results/serve.json, or bench/results/serve_overhead.json]")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts for the HTTP overhead")
    ap.add_argument("--only-overhead", action="store_true", help="measure only the HTTP overhead (1 slot)")
    a = ap.parse_args()
    a.out = a.out or ROOT / "bench" / "results" / ("serve_overhead.json" if a.only_overhead else "serve.json")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from dflash_export.demo.artifact import demo_artifact
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.ort.backend import OrtBackend
    from tokenizers import Tokenizer

    art = a.artifact or demo_artifact()
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(x)["prompt"] for x in lines if x.strip()][: a.prompts]
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    report: dict = {"artifact": str(art), "prompts": len(prompts), "max_tokens": a.max_tokens, "cpus": os.cpu_count(),
                    "runs": []}

    # in-process reference (also the greedy outputs every run must reproduce)
    backend = OrtBackend(art, threads=1)
    ids = [tok.encode(p).ids for p in prompts]
    generate(backend, ids[0], 8)
    want = {sp: [generate(backend, x, a.max_tokens, draft=sp).tokens for x in ids] for sp in (True, False)}

    for slots in (1,) if a.only_overhead else (1, 2):
        s = Server(art, "--slots", slots)
        try:
            for sp in () if a.only_overhead else (True, False):
                load(s, prompts[:2], 8, 2, sp)  # warm-up
                for conc in (1, 2, 4):
                    r = load(s, prompts, a.max_tokens, conc, sp)
                    r |= {"slots": slots, "speculative": sp, "concurrency": conc,
                          "lossless": r.pop("outputs") == want[sp]}
                    report["runs"].append(r)
                    print(f"slots {slots} {'spec ' if sp else 'plain'} conc {conc}: {r['tokens_per_s']:.0f} tok/s, "
                          f"TTFT p50 {r['ttft_ms']['p50']:.1f} p99 {r['ttft_ms']['p99']:.1f} ms, inter-chunk p50 "
                          f"{r['inter_chunk_ms']['p50']:.1f} p99 {r['inter_chunk_ms']['p99']:.1f} ms, TPOT p50 "
                          f"{r['tpot_ms']['p50']:.2f} ms, lossless {r['lossless']}", flush=True)
            if slots == 1:  # HTTP overhead at concurrency 1, interleaved with the in-process loop
                load(s, prompts[:2], 8, 1, True)  # warm-up
                http_t = inproc_t = 0.0
                n_http = n_in = 0
                passes = []  # overhead % of each pass: the spread says how much the noise weighs
                for _ in range(a.repeats):
                    pass_http = pass_in = 0.0
                    for p, x in zip(prompts, ids):
                        r = s.post("/v1/completions", {"prompt": p, "max_tokens": a.max_tokens, "temperature": 0,
                                                       "cache_prompt": False})
                        pass_http, n_http = pass_http + r["total"], n_http + len(r["tokens"])
                        t0 = time.perf_counter()
                        g = generate(backend, x, a.max_tokens)
                        pass_in, n_in = pass_in + time.perf_counter() - t0, n_in + len(g.tokens)
                    passes.append(100 * (1 - pass_in / pass_http))  # same tokens both ways: a time ratio
                    http_t, inproc_t = http_t + pass_http, inproc_t + pass_in
                http_rate, in_rate = n_http / http_t, n_in / inproc_t
                report["http_overhead"] = {"http_tokens_per_s": http_rate, "in_process_tokens_per_s": in_rate,
                                           "overhead_pct": 100 * (1 - http_rate / in_rate), "passes_pct": passes}
                print(f"HTTP overhead at concurrency 1: {http_rate:.0f} vs {in_rate:.0f} tok/s in process "
                      f"({report['http_overhead']['overhead_pct']:.1f}%; passes "
                      f"{', '.join(f'{x:.1f}' for x in passes)}%)", flush=True)
                if a.only_overhead:
                    continue
                # prompt reuse: a second turn extending the first
                saved = {True: [], False: []}
                for p in prompts:
                    first = s.post("/v1/completions", {"prompt": p, "max_tokens": a.max_tokens, "temperature": 0})
                    turn2 = p + tok.decode(first["tokens"]) + "\n\nNext, "
                    for cache in (True, False):  # cached first (the slot holds turn 1), then a full prefill
                        r = s.post("/v1/completions", {"prompt": turn2, "max_tokens": 4, "temperature": 0,
                                                       "cache_prompt": cache})
                        saved[cache].append((r["arrivals"][0], r["timings"]["cache_n"], r["timings"]["prompt_n"]))
                report["prompt_reuse"] = {
                    k: {"ttft_ms_p50": pct([x[0] for x in v], 50), "cached_tokens_mean": float(np.mean([x[1] for x in v])),
                        "prefilled_tokens_mean": float(np.mean([x[2] for x in v]))}
                    for k, v in (("cache_prompt", saved[True]), ("no_cache", saved[False]))}
                print(f"prompt reuse (2nd turn): {report['prompt_reuse']}", flush=True)
        finally:
            s.stop()

    if a.only_overhead:
        a.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}")
        return
    # memory: 1 vs 4 slots, after every slot served one request
    m = backend.manifest
    kv = 2 * m.target_layers * m.max_context * m.target_kv_heads * m.target_head_dim * 4
    kv += 2 * m.draft_layers * m.max_context * m.draft_kv_heads * m.draft_head_dim * 4
    weights = sum(p.stat().st_size for p in art.glob("*.data"))
    rss = {}
    for slots in (1, 4):
        s = Server(art, "--slots", slots)
        try:
            load(s, prompts[:4], a.max_tokens, 4, True)
            rss[slots] = s.rss_mb()
        finally:
            s.stop()
    report["memory"] = {"rss_mb_1_slot": rss[1], "rss_mb_4_slots": rss[4], "difference_mb": rss[4] - rss[1],
                        "kv_buffers_mb_per_slot_full_context": kv / 2**20, "weights_mb": weights / 2**20}
    print(f"memory: {report['memory']}", flush=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
