"""Batched vs slotted serving over HTTP: aggregate decode tokens/s at 1, 2, 4, 8 concurrent requests.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/serve_batch.py                  # demo pair
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/serve_batch.py --artifact OUT --prompt-tokens 300 \\
        --max-tokens 40 --out bench/serve_batch_06b.json                          # a real-width export

Two servers on the same artifact run side by side: `--max-batch B` (one batched loop) and
`--slots S` (a loop per slot over shared sessions; `--servers batched` runs only the first).
For each mode (speculative, plain), --repeats times: each concurrency c in turn, the same c
requests (streamed, greedy, c different prompts started at once) to the batched server, then
to the slotted one, so every ratio can compare runs made seconds apart on the same noisy
machine: the best run of each is reported, and the median over repeats of the paired ratios
(batched / slots; c clients / the first concurrency). The load (`uptime`) is recorded before
and after.

Per run:
- decode_tokens_per_s: the tokens that arrived while all c requests were decoding (from the
  last request's first token to the first request's last token) over that window: the
  aggregate decode rate of c concurrent requests, prefill excluded (NaN when c exceeds the
  server's rows or slots: the queued requests never decode beside the first ones);
- e2e_tokens_per_s: all tokens over the wall time of the c requests (prefills included);
- tokens_per_cpu_s: all tokens over the CPU time the server process used for them (all its
  threads): what a token costs, which other jobs on a shared machine disturb far less than
  the wall-clock rates (they take cores away, not add CPU seconds to ours);
- lossless: every output equals the in-process batch-1 `generate` of its prompt (--check),
  else the two servers' outputs equal each other.
An artifact whose runtime.json sets a verify policy (e.g. theta 2, min_len 6: every
verify 6 positions, as bench/batch.py measures random weights) is served with it (--verify auto).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from serve import Server  # bench/serve.py's server process and streamed POST
from common import machine, parser, uptime, write_report

ROOT = Path(__file__).resolve().parents[1]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(server: Server, prompts: list, max_tokens: int, speculative: bool) -> dict:
    body = lambda p: {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "speculative": speculative,  # noqa: E731
                      "cache_prompt": False}
    c0, t0 = cpu_s(server.proc.pid), time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        rs = list(pool.map(lambda p: server.post("/v1/completions", body(p)), prompts))
    wall, cpu = time.perf_counter() - t0, cpu_s(server.proc.pid) - c0
    # arrivals are relative to each request's own start; the requests start together (within ~ms)
    lo = max(r["arrivals"][0] for r in rs)
    hi = min(r["arrivals"][-1] for r in rs)
    inside = sum(len(ids) for r in rs for t, ids in zip(r["arrivals"], r["chunks"]) if lo < t <= hi)
    n = sum(len(r["tokens"]) for r in rs)
    return {"decode_tokens_per_s": inside / (hi - lo) if hi > lo and inside else float("nan"),
            "decode_window_s": hi - lo, "e2e_tokens_per_s": n / wall, "tokens": n, "tokens_per_cpu_s": n / cpu,
            "tau": float(np.mean([r["timings"]["mean_acceptance_length"] for r in rs])),
            "outputs": [r["tokens"] for r in rs]}


def main() -> None:
    ap = parser(__doc__, out="serve_batch.json", json_flag=False)
    ap.add_argument("--artifact", type=Path, help="exported directory [default: the demo pair, exported once]")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, help="random token-id prompts of this length [default: the demo prompts]")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="speculative,plain")
    ap.add_argument("--servers", default="batched,slots", help="which of the two servers to run (batched, slots)")
    ap.add_argument("--same-prompt", action="store_true",
                    help="every client sends the first prompt: the same work per request at every concurrency, so "
                         "the ratios between concurrencies compare like with like (different prompts accept differently)")
    ap.add_argument("--check", action="store_true", help="also compare every output with in-process generate")
    a = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from dflash_export.demo.artifact import demo_artifact
    from dflash_export.runtime.manifest import load_manifest

    art = a.artifact or demo_artifact()
    m = load_manifest(art, verify=False)
    levels = [int(x) for x in a.concurrency.split(",")]
    if a.prompt_tokens:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, m.vocab_size - 2, a.prompt_tokens).tolist() for _ in range(max(levels))]
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(art / "tokenizer.json"))
        lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()
        prompts = [tok.encode(json.loads(x)["prompt"]).ids for x in lines if x.strip()][: max(levels)]
    if a.same_prompt:
        prompts = [prompts[0]] * len(prompts)
    report = {"artifact": str(art), "hidden": m.hidden_size, "vocab": m.vocab_size, "block": m.block_size,
              "max_tokens": a.max_tokens, "prompt_tokens": [len(p) for p in prompts], "cpus": os.cpu_count(),
              "servers": {k: v for k, v in {"batched": f"--max-batch {a.max_batch}", "slots": f"--slots {a.slots}"}.items()
                          if k in a.servers.split(",")},
              "machine": machine(), "load_before": uptime(), "runs": []}
    print(report["load_before"], flush=True)
    want = {}
    if a.check:
        from dflash_export.runtime.loop import generate
        from dflash_export.runtime.ort.backend import OrtBackend

        be = OrtBackend(art)
        want = {sp: [generate(be, p, a.max_tokens, draft=sp).tokens for p in prompts] for sp in (True, False)}
        be.close()
    make = {"batched": lambda: Server(art, "--max-batch", a.max_batch), "slots": lambda: Server(art, "--slots", a.slots)}
    servers = {name: make[name]() for name in a.servers.split(",")}
    try:
        for sp in [x == "speculative" for x in a.modes.split(",")]:
            for c in levels:  # warm-up: ONNX Runtime plans each new call shape (rows x positions) on its first run
                for s in servers.values():
                    run(s, prompts[:c], min(a.max_tokens, 24), sp)
            got: dict = {}  # (c, server) -> one run per repeat; every repeat runs every c on every server in turn
            for _ in range(a.repeats):
                for c in levels:
                    for name, s in servers.items():
                        got.setdefault((c, name), []).append(run(s, prompts[:c], a.max_tokens, sp))
            keys = ("decode_tokens_per_s", "e2e_tokens_per_s", "tokens_per_cpu_s")
            med = lambda xs, ys: {k: round(float(np.nanmedian([x[k] / y[k] for x, y in zip(xs, ys)])), 3)  # noqa: E731
                                  for k in keys}
            for c in levels:
                best = {name: max(got[c, name], key=lambda r: r["decode_tokens_per_s"]) for name in servers}
                outs = {k: [r["outputs"] for r in got[c, k]] for k in servers}
                for name, r in best.items():
                    same = all(o == outs[name][0] for o in outs[name])  # every repeat gave the same outputs
                    ok = same and (outs[name][0] == want[sp][:c] if want else
                                   outs[name][0] == outs["slots"][0] if "slots" in outs else None)
                    row = {"server": name, "speculative": sp, "concurrency": c, "lossless": ok,
                           **{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "outputs"}}
                    if name == "batched" and "slots" in servers:  # runs made back to back
                        row["paired_batched_over_slots_median"] = med(got[c, "batched"], got[c, "slots"])
                    if c != levels[0]:
                        row[f"paired_over_c{levels[0]}_median"] = med(got[c, name], got[levels[0], name])
                    report["runs"].append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    write_report(report, a.out, ratios)


def ratios(runs: list[dict]) -> dict:
    """Decode aggregate at c concurrent requests over the same server's at 1, and batched over slots."""
    out = {}
    for key in ("decode_tokens_per_s", "tokens_per_cpu_s"):
        at = {(r["server"], r["speculative"], r["concurrency"]): r[key] for r in runs}
        for (name, sp, c), v in sorted(at.items()):
            mode = "speculative" if sp else "plain"
            one = at.get((name, sp, 1))
            if one:
                out[f"{key}: {name} {mode} c{c} / c1"] = round(v / one, 2)
            if name == "batched" and at.get(("slots", sp, c)):
                out[f"{key}: batched / slots {mode} c{c}"] = round(v / at[("slots", sp, c)], 2)
    for r in runs:  # the same, as the median over repeats of runs made seconds apart
        for k, v in r.get("paired_over_c1_median", {}).items():
            out[f"paired median {k}: {r['server']} {'speculative' if r['speculative'] else 'plain'} "
                f"c{r['concurrency']} / c1"] = v
    return out


if __name__ == "__main__":
    main()
