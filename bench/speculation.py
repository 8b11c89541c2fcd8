"""Speculation auto vs always vs never on the demo pair: in-domain, off-domain, and a mixed
stream through the server at concurrency 1 and 4. Every ratio is the median of interleaved
pairs in one process; tau is over drafted rounds only, with the rounds each way beside it.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/speculation.py --art ART [--pairs 5] [--verify auto|full] [--out F]

ART: the demo pair exported as `dflash-export demo` exports it (fp32, --attention ort,
context 1024) and calibrated with 1 thread (runtime.json: the verify policy and the
controller's round costs); when ART holds no export, this script makes it first
(`dflash-export export` + `dflash-export bench --calibrate --threads 1`: 80 s at load 7 on 2
vCPUs). The measurements took 4.3 min at load 7-9 there (`--pairs 5`, 8 prompts per set).

- off-domain: demo/prompts-offdomain.jsonl (random vocabulary text), auto vs never (plain),
  decode tokens/s over all prompts, one ratio per pair (within a pair the modes take turns
  prompt by prompt, the first alternating, so a slow stretch of the machine hits both);
- in-domain: demo/prompts.jsonl (held-out Python code), auto vs always; and always vs always
  (`aa`), the same measurement with nothing to find: how far a ratio moves by noise alone;
- mixed: one server (`serve ART --max-batch 4`, speculation auto) fed the two prompt sets
  alternately at each concurrency; the mode set per request (`speculative`: true = auto,
  "always", false = never); aggregate tokens/s, auto over the better of always and never. At
  concurrency 1 the modes take turns request by request (the wall time is the requests' own),
  and `best_fixed_per_set_vs_better` is what knowing each request's set would give: each set
  in its faster fixed mode, over the better mode for the whole stream; above concurrency 1
  each mode runs the whole stream, the three in rotating order.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import uptime, write_report  # noqa: E402
from serve import Server  # noqa: E402  (bench/serve.py)

from dflash_export.runtime.controller import controller_for, rounds_of  # noqa: E402
from dflash_export.runtime.load import open_artifact  # noqa: E402
from dflash_export.runtime.settings import RunOptions  # noqa: E402
from dflash_export.runtime.loop import generate  # noqa: E402
from dflash_export.runtime.measure import rate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def prompts(name: str, n: int) -> list[str]:
    lines = (ROOT / "demo" / name).read_text().splitlines()
    return [json.loads(x)["prompt"] for x in lines if x.strip()][:n]


def loop_pairs(art: Path, texts: list[str], new: int, a: str, b: str, pairs: int, verify: str = "auto") -> dict:
    """`pairs` runs of modes a and b over all prompts, interleaved prompt by prompt: per-pair ratio
    of decode tokens/s (each mode's controller lasts the pair, as a server's lasts its requests)."""
    be, cfg = open_artifact(art, RunOptions(verify=verify))
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    ids = [tok.encode(t).ids for t in texts]
    k = be.manifest.block_size

    def run(order):  # prompt by prompt, each mode in turn (the order alternates): drift hits both alike
        mode = {m: m.split(":")[0] for m in order}  # "always:2": a second label of the same mode (an A/A pair)
        ctl = {m: controller_for(mode[m], cfg.costs, k) for m in order}
        got = {m: [] for m in order}
        for j, p in enumerate(ids):
            for m in (order if j % 2 == 0 else order[::-1]):
                got[m].append(generate(be, p, new, draft=mode[m] != "never", verify=cfg.verify, control=ctl[m]))
        return got

    run((a, b))  # warm-up
    ratios, rates, rounds, taus, same = [], {a: [], b: []}, {a: [], b: []}, {a: [], b: []}, True
    for i in range(pairs):
        got = run((a, b) if i % 2 == 0 else (b, a))
        ratios.append(rate(got[a]) / rate(got[b]))
        for m in (a, b):
            rates[m].append(rate(got[m]))
            rounds[m].append(rounds_of(got[m]))
            drafted = [n for g in got[m] for n, d in zip(g.acceptance_lengths, g.drafted) if d]
            taus[m].append(float(np.mean(drafted)) if drafted else None)
        same = same and all(x.tokens == y.tokens for x, y in zip(got[a], got[b]))
    be.close()
    return {"modes": [a, b], "prompts": len(ids), "max_new_tokens": new, "ratios": ratios,
            "median_ratio": float(np.median(ratios)), "tokens_per_second": rates, "rounds": rounds,
            "tau_drafted_rounds": taus, "identical_tokens": same}


def mixed_stream(server: Server, code: list[str], off: list[str], new: int, passes: int, concurrency: int) -> dict:
    stream = [p for pair in zip(code, off) for p in pair]  # alternating requests from both sets
    modes = {"auto": True, "always": "always", "never": False}

    def post(p, mode):
        return server.post("/v1/completions", {"prompt": p, "max_tokens": new, "temperature": 0,
                                               "speculative": modes[mode], "cache_prompt": False})

    def summary(rs, wall):
        ts = [r["timings"] for r in rs]
        plain = sum(t.get("plain_rounds", 0) for t in ts)
        drafted = sum(t["rounds"] for t in ts) - plain
        return {"tokens_per_second": sum(len(r["tokens"]) for r in rs) / wall,
                "rounds": {"drafted": drafted, "plain": plain},
                "tau_drafted_rounds": (sum(t["draft_n_accepted"] for t in ts) + drafted) / drafted if drafted else None,
                "outputs": [r["tokens"] for r in rs]}

    def run(mode):  # the stream at `concurrency`
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            rs = list(pool.map(lambda p: post(p, mode), stream))
        return summary(rs, time.perf_counter() - t0)

    def lockstep(order):  # one request at a time, each mode in turn: drift hits the modes alike
        rs = {m: [] for m in order}
        for j, p in enumerate(stream):
            for m in order[j % 3:] + order[: j % 3]:
                rs[m].append(post(p, m))
        got = {m: summary(v, sum(r["total"] for r in v)) for m, v in rs.items()}
        for m, v in rs.items():  # per set (requests alternate code, off-domain): seconds
            got[m]["seconds_code_off"] = [sum(r["total"] for r in v[i::2]) for i in (0, 1)]
        # the ceiling of choosing per request: each set in its faster fixed mode
        best = sum(min(got["always"]["seconds_code_off"][i], got["never"]["seconds_code_off"][i]) for i in (0, 1))
        got["auto"]["best_fixed_per_set_tokens_per_second"] = sum(len(r["tokens"]) for r in rs["never"]) / best
        return got

    names = list(modes)
    for m in names:  # warm-up
        run(m)
    out = {m: [] for m in modes}
    ratios, ceilings, same = [], [], True
    for i in range(passes):
        order = names[i % 3:] + names[: i % 3]
        got = lockstep(order) if concurrency == 1 else {m: run(m) for m in order}
        better = max(got["always"]["tokens_per_second"], got["never"]["tokens_per_second"])
        ratios.append(got["auto"]["tokens_per_second"] / better)
        if "best_fixed_per_set_tokens_per_second" in got["auto"]:
            ceilings.append(got["auto"]["best_fixed_per_set_tokens_per_second"] / better)
        same = same and got["auto"]["outputs"] == got["always"]["outputs"] == got["never"]["outputs"]
        for m in modes:
            out[m].append({k: v for k, v in got[m].items() if k != "outputs"})
    return {"requests": len(stream), "concurrency": concurrency, "max_tokens": new, "by_mode": out,
            "ratios_auto_vs_better": ratios, "median_ratio": float(np.median(ratios)), "identical_tokens": same,
            "best_fixed_per_set_vs_better": ceilings}


def prepare(art: Path) -> None:
    """ART as the demo makes it (fp32, --attention ort, context 1024), calibrated with 1 thread."""
    if (art / "manifest.json").is_file() and (art / "runtime.json").is_file():
        return
    cli = [sys.executable, "-c", "from dflash_export.cli import main; main()"]
    pair = ROOT / "demo" / "pair"
    subprocess.run(cli + ["export", "--target", str(pair / "target"), "--draft", str(pair / "draft"), "--out", str(art),
                          "--max-context", "1024", "--attention", "ort", "--force"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(cli + ["bench", str(art), "--calibrate", "--threads", "1"], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--art", type=Path, required=True)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=24, help="prompts per set (the sets hold 24)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4", help="mixed stream: concurrencies (one server, --max-batch the largest)")
    ap.add_argument("--parts", default="off,in,aa,mixed", help="aa: always against itself, the method's spread")
    ap.add_argument("--verify", choices=("auto", "full"), default="auto",
                    help="auto: the calibrated verify policy; full: the whole block (as static TensorRT engines)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speculation.json")
    args = ap.parse_args()
    prepare(args.art)
    code, off = prompts("prompts.jsonl", args.prompts), prompts("prompts-offdomain.jsonl", args.prompts)
    entry = json.loads((args.art / "runtime.json").read_text()).get("devices", {}).get("ort:cpu", {})
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "load_before": uptime(),
              "command": " ".join(sys.argv), "settings": {"threads": entry.get("threads"), "verify": entry.get("verify") if args.verify == "auto" else "full",
                                                          "costs": entry.get("costs") or "default"}, "runs": {}}
    runs, parts = report["runs"], args.parts.split(",")
    if "off" in parts:
        runs["off_domain_auto_vs_never"] = loop_pairs(args.art, off, args.max_new_tokens, "auto", "never", args.pairs, args.verify)
        print("off-domain auto/never", runs["off_domain_auto_vs_never"]["ratios"], flush=True)
    if "aa" in parts:  # the method's own spread: the same mode on both sides
        runs["in_domain_always_vs_always"] = loop_pairs(args.art, code, args.max_new_tokens, "always:2", "always",
                                                        args.pairs, args.verify)
        print("in-domain always/always", runs["in_domain_always_vs_always"]["ratios"], flush=True)
    if "in" in parts:
        runs["in_domain_auto_vs_always"] = loop_pairs(args.art, code, args.max_new_tokens, "auto", "always", args.pairs, args.verify)
        print("in-domain auto/always", runs["in_domain_auto_vs_always"]["ratios"], flush=True)
    if "mixed" in parts:
        cs = [int(c) for c in args.concurrency.split(",")]
        server = Server(args.art, "--max-batch", str(max(cs)), "--verify", args.verify)
        try:
            for c in cs:
                runs[f"mixed_serve_c{c}"] = mixed_stream(server, code, off, args.max_new_tokens, args.pairs, c)
                print(f"mixed c={c} auto/better", runs[f"mixed_serve_c{c}"]["ratios_auto_vs_better"], flush=True)
        finally:
            server.stop()
    write_report(report, args.out, lambda runs: {k: v["median_ratio"] for k, v in runs.items()})


if __name__ == "__main__":
    main()
