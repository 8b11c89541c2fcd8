"""The demo pair's speculative decoding against llama.cpp's, each thread count pinned to as many cores.

For each --threads N this process pins itself (and so every child) to the first N allowed
cores, then runs --rounds interleaved rounds of: llama.cpp plain (llama-completion) and its
DFlash (llama-speculative-simple --spec-type draft-dflash) on each prompt, and ours (each
--ours export, speculative and plain, through the runtime's own loop) with ONNX Runtime's idle
workers blocking and, for N > 1, spinning. Best round of each kept (a busy machine only slows
a run down). Then ours' per-call costs at each setting (10th percentile of 21 interleaved calls:
plain step, verify of 8 and of K positions, draft_block, draft_context) and the context switches
(voluntary: blocking waits) per step and per 8-position verify (a worker that does not spin
blocks after every parallel op and is woken for the next). The goal line: ours'
best speculative rate over every setting against llama.cpp's best (plain or DFlash) over the
thread counts.

Needs: the llama.cpp build and the demo pair's GGUFs under the llama.cpp cache
(~/.cache/dflash-export/llamacpp or DFLASH_LLAMACPP_CACHE: build/bin, gguf/demo/{target,draft}-f32.gguf;
converted here from the vendored source when missing) and our exports (`export --attention ort`,
calibrated by `bench --calibrate` or --calibrate here: their runtime.json's verify policy is used).
No torch. About a minute per thread count on a quiet machine with the defaults.

    python bench/spec_cores.py --ours b16=DIR [--ours b8=DIR] [--threads 1,2] [--rounds 3] [--prompts 3]
        [--max-new-tokens 64] [--calibrate] [--json]

The last line of stdout is the JSON list of rows {threads, what, tok_s, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
from common import ROOT, machine
from llamacpp import CACHE, convert, llama_dflash, llama_plain, prompt_file

from dflash_export.runtime import manifest as M
from dflash_export.runtime.calibrate import calibrate, round_costs
from dflash_export.runtime.measure import measure_many, rate
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.settings import RunOptions, resolve


def ggufs() -> tuple[Path, Path, Path]:
    """(bin dir, target GGUF, draft GGUF); converted with llama.cpp's converter when missing."""
    bins, g = CACHE / "build" / "bin", CACHE / "gguf" / "demo"
    if not (bins / "llama-speculative-simple").is_file():
        raise SystemExit(f"no llama.cpp build in {bins}: run bench/vs_llamacpp.py once (it builds), or set DFLASH_LLAMACPP_CACHE")
    tdir, ddir = ROOT / "demo" / "pair" / "target", ROOT / "demo" / "pair" / "draft"
    src = CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    tg = g / "target-f32.gguf"
    tg = tg if tg.is_file() else convert(src, tdir, tg)
    dg = g / "draft-f32.gguf"
    dg = dg if dg.is_file() else convert(src, ddir, dg, tdir)
    os.environ["LD_LIBRARY_PATH"] = f"{bins}:{os.environ.get('LD_LIBRARY_PATH', '')}"  # a copied build's libraries
    return bins, tg, dg


def switches() -> int:
    """Voluntary context switches so far of every thread of this process (/proc: a thread that blocks
    counts one when it is woken; preemption by other jobs is the involuntary kind, left out)."""
    n = 0
    for st in Path("/proc/self/task").glob("*/status"):
        for ln in st.read_text().splitlines():
            if ln.startswith("voluntary_ctxt_switches"):
                n += int(ln.split()[1])
    return n


def call_costs(be: OrtBackend, prompt: list[int], calls: int = 200) -> dict:
    """ms of ours' calls at one setting (the calibration's own measurement: runtime/calibrate.py
    round_costs), and the context switches per plain step and per 8-position verify: ONNX
    Runtime's workers that block between parallel ops block and are woken for each (not when they spin)."""
    c = round_costs(be, prompt, 1)
    k = len(c["verify"])
    out = {"step": c["step"], "verify8": c["verify"][min(8, k) - 1], f"verify{k}": c["verify"][-1],
           "draft_block": c["draft"], "draft_context": c["context"]}
    be.reset()
    be.target(np.asarray(prompt, np.int64))
    be.commit(len(prompt))
    for s in (1, min(8, k)):
        ids = np.asarray((prompt * k)[:s], np.int64)
        n0 = switches()
        for _ in range(calls):
            be.target(ids)
            be.commit(0)
        out[f"blocks_per_call_{s}"] = (switches() - n0) / calls
    be.reset()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", action="append", required=True, metavar="LABEL=DIR", help="an export (--attention ort)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="demo/prompts.jsonl prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--n-max", type=int, default=15, help="llama.cpp --spec-draft-n-max")
    ap.add_argument("--calibrate", action="store_true",
                    help="`bench --calibrate` each export first over --threads, on 4 other demo prompts (its verify policy is then used)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from tokenizers import Tokenizer

    ours = {k: Path(d) for k, _, d in (x.partition("=") for x in a.ours)}
    threads = [int(t) for t in a.threads.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    if max(threads) > len(cores):
        raise SystemExit(f"--threads {max(threads)}: only {len(cores)} cores are allowed here")
    bins, tg, dg = ggufs()
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()
    all_texts = [json.loads(ln)["prompt"] for ln in lines if ln.strip()]
    texts = all_texts[: a.prompts]
    tok = Tokenizer.from_file(str(ROOT / "demo" / "pair" / "target" / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in texts]
    work = Path(tempfile.mkdtemp(prefix="spec_cores."))
    pfiles = [prompt_file(work / f"p{i}", p) for i, p in enumerate(texts)]
    load0, rows = os.getloadavg(), []
    for d in ours.values() if a.calibrate else ():
        os.sched_setaffinity(0, cores[: max(threads)])
        held_out = [tok.encode(t).ids for t in all_texts[a.prompts : a.prompts + 4]]  # not the measured prompts
        calibrate(d, RunOptions(), threads, held_out, a.max_new_tokens, 1,
                  log=lambda msg: print(f"calibrate {d.name}: {msg}", flush=True))
    for t in threads:
        os.sched_setaffinity(0, cores[:t])  # this process and every child: llama.cpp's, ORT's threads
        backends, verify = {}, {}
        for label, d in ours.items():
            s = resolve(d, M.load_manifest(d), RunOptions(threads=t))
            for spin in (False, True) if t > 1 else (False,):
                key = f"{label}{' spin' if spin else ''}"
                backends[key] = OrtBackend(d, threads=t, spin=spin, max_chunk=s.prefill_chunk or 256)
                verify[key] = s.verify
        best: dict[str, dict] = {}

        def keep(what: str, r: dict, by: str = "tok_s") -> None:
            if what not in best or r[by] > best[what][by]:
                best[what] = r

        for i in range(a.rounds):
            plain = [llama_plain(bins, tg, f, a.max_new_tokens, t, a.max_context) for f in pfiles]
            keep("llama.cpp plain", {"tok_s": np.mean([r["tok_s"] for r in plain])})
            spec = [llama_dflash(bins, tg, dg, f, p, a.max_new_tokens, t, a.max_context, a.n_max) for f, p in zip(pfiles, texts)]
            keep("llama.cpp DFlash", {"tok_s": np.mean([r["tok_s"] for r in spec]), "tau": np.mean([r["tau"] for r in spec])})
            for key, be in backends.items():
                sp, ba = measure_many({0: be}, prompts, a.max_new_tokens, warmup=1 if i == 0 else 0, verify=verify[key])[0]
                same = all(x.tokens == y.tokens for x, y in zip(sp, ba))
                tau = sum(len(g.tokens) - 1 for g in sp) / max(1, sum(len(g.acceptance_lengths) for g in sp))
                keep(f"ours {key} speculative", {"tok_s": rate(sp), "tau": tau, "lossless": same})
                keep(f"ours {key} plain", {"tok_s": rate(ba)})
        for key, be in backends.items():
            best[f"ours {key} speculative"]["ms"] = call_costs(be, prompts[0])
            be.close()
        for what, r in best.items():
            rows.append({"threads": t, "what": what, **{k: (float(v) if isinstance(v, np.floating) else v) for k, v in r.items()}})
            print(f"{t} thread(s)  {what:28s} {r['tok_s']:8.0f} tok/s" + (f"  tau {r['tau']:.2f}" if "tau" in r else "")
                  + (f"  ms {json.dumps({k: round(v, 2) for k, v in r['ms'].items()})}" if "ms" in r else ""), flush=True)
    os.sched_setaffinity(0, cores)
    theirs = max((r for r in rows if r["what"].startswith("llama")), key=lambda r: r["tok_s"])
    mine = max((r for r in rows if r["what"].endswith("speculative")), key=lambda r: r["tok_s"])
    goal = {"ours_best": mine, "llama_best": theirs, "ratio": mine["tok_s"] / theirs["tok_s"],
            "machine": machine(), "cores": len(cores), "load": [load0[0], os.getloadavg()[0]]}
    print(f"ours best {mine['what']} at {mine['threads']} thread(s) {mine['tok_s']:.0f} tok/s vs llama.cpp best "
          f"{theirs['what']} at {theirs['threads']} {theirs['tok_s']:.0f}: {goal['ratio']:.2f}x; load {goal['load']}")
    if a.json:
        print(json.dumps(goal))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
