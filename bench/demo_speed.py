"""The demo pair's speculative decoding against llama.cpp, per thread setting, interleaved in one run.

    .venv/bin/python bench/demo_speed.py --work /tmp/demo_speed [--rounds 8] [--threads 1,2] [--prompts 8]
        [--exports standard,ort] [--spin]

llama.cpp's figures are its `llama-bench` tg (plain decoding of --new-tokens at the prompts' mean
depth) and its DFlash (`llama-speculative-simple --spec-type draft-dflash`, greedy) at each thread
count; ours are the speculative loop's decode tokens/s (`generate`, greedy, full-block verify,
every round drafted) on the same prompts, per export flavour and thread setting (`2+spin`: two
threads spinning within a call, bench/llamacpp.py builds llama.cpp), the backends held in this
process. One round runs every configuration of both engines once, in turn; the machine's load
changes within minutes on shared vCPUs, so each configuration's median over rounds is reported,
and `ratio` = our best configuration's median / llama.cpp's best median (plain or DFlash, at
any thread count). Per-call medians (ms) show where a round's time goes. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine
from llamacpp import build_llamacpp, convert, llama_bench, llama_dflash, prompt_file


def ours_configs(work: Path, exports: list[str], threads: list[int], spin: bool) -> dict:
    """{label: backend} for each export flavour (the demo pair, exported once into work) and thread setting."""
    from dflash_export.export.artifact import export_artifact
    from dflash_export.runtime.ort.backend import OrtBackend

    out = {}
    for name in exports:
        attention, _, block = name.partition("-b")  # "ort-b8": --attention ort --block-size 8
        d = work / f"demo-{name}"
        if not (d / "manifest.json").is_file():
            export_artifact(ROOT / "demo/pair/target", ROOT / "demo/pair/draft", d, attention=attention,
                            block_size=int(block) if block else None, force=True, progress=False)
        for t in threads:
            out[f"{name} {t}t"] = OrtBackend(d, threads=t)
            if spin and t > 1:
                out[f"{name} {t}t+spin"] = OrtBackend(d, threads=t, spin=True)
    return out


def ours_run(be, prompts: list[list[int]], n: int) -> dict:
    """Speculative decode tokens/s over the prompts and the per-round call times (ms, medians)."""
    from dflash_export.runtime.loop import generate

    gens = [generate(be, p, n, stop_token_ids=()) for p in prompts]
    rounds = [r for g in gens for r in g.round_s]
    toks = sum(len(g.tokens) - 1 for g in gens)
    return {"tok_s": toks / sum(g.decode_s for g in gens), "tau": statistics.mean(a for g in gens for a in g.acceptance_lengths),
            "draft_ms": 1e3 * statistics.median(r[0] for r in rounds), "verify_ms": 1e3 * statistics.median(r[1] for r in rounds),
            "host_ms": 1e3 * statistics.median(r[2] for r in rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "demo_speed")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompts", type=int, default=8, help="demo/prompts.jsonl prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--exports", default="standard,ort", help="flavours of our export (NAME-bK: block size K)")
    ap.add_argument("--spin", action="store_true", help="also our multi-thread settings with spinning")
    ap.add_argument("--dflash-n-max", type=int, default=15, help="llama.cpp's --spec-draft-n-max")
    a = ap.parse_args()
    from tokenizers import Tokenizer

    a.work.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in a.threads.split(",")]
    src, bins = build_llamacpp()
    tdir, ddir = ROOT / "demo/pair/target", ROOT / "demo/pair/draft"
    tg, dg = convert(src, tdir, a.work / "target-f32.gguf"), convert(src, ddir, a.work / "draft-f32.gguf", tdir)
    texts = [json.loads(ln)["prompt"] for ln in (ROOT / "demo/prompts.jsonl").read_text().splitlines() if ln.strip()]
    texts = texts[: a.prompts]
    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in texts]
    depth = round(statistics.mean(len(p) for p in prompts))
    pfiles = [prompt_file(a.work / f"p{i}", p) for i, p in enumerate(texts)]
    ours = ours_configs(a.work, a.exports.split(","), threads, a.spin)
    for be in ours.values():  # warm-up: shapes, pages
        ours_run(be, prompts[:1], 8)
    res: dict[str, list] = {}
    load = [os.getloadavg()[0]]
    for r in range(a.rounds):
        for t in threads:
            res.setdefault(f"llama.cpp plain {t}t", []).append(llama_bench(bins, tg, t, n=a.new_tokens, depth=depth)["tok_s"])
            runs = [llama_dflash(bins, tg, dg, f, p, a.new_tokens, t, 4096, a.dflash_n_max) for f, p in zip(pfiles, texts)]
            res.setdefault(f"llama.cpp DFlash {t}t", []).append(statistics.mean(x["tok_s"] for x in runs))
        for label, be in ours.items():
            res.setdefault(f"ours {label}", []).append(ours_run(be, prompts, a.new_tokens))
        load.append(os.getloadavg()[0])
        print(f"round {r + 1}/{a.rounds} done, load {load[-1]:.1f}", file=sys.stderr)
    table = {}
    for label, xs in res.items():
        rates = [x["tok_s"] if isinstance(x, dict) else x for x in xs]
        entry = {"median_tok_s": round(statistics.median(rates), 1), "best_tok_s": round(max(rates), 1)}
        if isinstance(xs[0], dict):
            entry |= {k: round(statistics.median(x[k] for x in xs), 3) for k in ("tau", "draft_ms", "verify_ms", "host_ms")}
        table[label] = entry
    best = lambda who: max((k for k in table if k.startswith(who)), key=lambda k: table[k]["median_tok_s"])  # noqa: E731
    o, ll = best("ours"), best("llama.cpp")
    print(json.dumps({"machine": machine(),
                      "load": [round(x, 1) for x in (min(load), max(load))], "prompts": a.prompts, "depth": depth,
                      "new_tokens": a.new_tokens, "rounds": a.rounds, "configs": table, "ours_best": o, "llama_best": ll,
                      "ratio": round(table[o]["median_tok_s"] / table[ll]["median_tok_s"], 3)}))


if __name__ == "__main__":
    main()
