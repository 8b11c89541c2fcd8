"""Plain decode step time of several exports, and of llama.cpp GGUFs, interleaved (CPU).

A shared machine's load changes within minutes: run one after another, the engines would be
compared at different loads, so each round decodes --tokens with every export in turn (one
process, ONNX Runtime) and runs `llama-bench` on every GGUF given (tg --tokens at the same
--depth and threads, its own process), and the best and median round per entry are reported.
Besides wall time, each round reads the user CPU time the engine spent per token (its process's,
or llama-bench's own from rusage): a run of SHORT tokens is subtracted from a run of SHORT +
--tokens, which cancels loading, the prompt and warm-up (user time only: loading's page faults
are system time, and varied by more than the tokens' cost). At 1 thread that figure is what a
load on a shared machine changes least (other jobs delay a run; they do not add to its own CPU
time); give --tokens 32 or more, as llama-bench's own start-up still varies.

    python bench/step_ms.py LABEL=DIR[,spin[=US]] [LABEL=FILE.gguf ...] [--threads 1] [--depth 64] [--tokens 12]
        [--rounds 4] [--cpus 0,1]

`,spin` opens that export with ONNX Runtime's intra-op spinning on (the runtime's default is
off), `,spin=50` with spinning bounded to 50 microseconds (session.intra_op.spin_duration_us).
--cpus pins this process and its llama-bench children to those CPUs (taskset's effect), for a
quiet many-core machine: e.g. --threads 2 --cpus 2,3. llama-bench is the cached build of
bench/llamacpp.py (never rebuilt here; run bench/vs_llamacpp.py once to build it).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
from pathlib import Path

import numpy as np

from common import machine, parser

from dflash_export.runtime.load import open_backend
from dflash_export.runtime.loop import generate

SHORT = 4  # tokens of the run subtracted from each measured one (CPU time)


def user_s(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_utime


def main() -> None:
    ap = parser(__doc__, json_flag=False)
    ap.add_argument("entries", nargs="+", metavar="LABEL=DIR|GGUF")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--depth", type=int, default=64, help="prompt tokens before decoding")
    ap.add_argument("--tokens", type=int, default=12, help="tokens decoded per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cpus", default=None, help="comma-separated CPU ids to pin to (both engines)")
    a = ap.parse_args()
    if a.cpus:
        os.sched_setaffinity(0, {int(c) for c in a.cpus.split(",")})
    entries = dict(x.split("=", 1) for x in a.entries)
    ggufs = {k: Path(v) for k, v in entries.items() if v.endswith(".gguf")}
    backends = {}
    for k, v in entries.items():
        if k not in ggufs:
            d, _, opt = v.partition(",")
            spin, _, us = opt.partition("=")
            backends[k] = open_backend(d, "ort", "cpu", threads=a.threads, drafter=False, spin=spin == "spin",
                                       spin_us=int(us) if us else None)
    vocab = min([b.manifest.vocab_size for b in backends.values()] or [32000])
    prompt = np.random.default_rng(0).integers(0, vocab, a.depth).tolist()
    for b in backends.values():  # warm-up: shapes, pages
        generate(b, prompt, 4, draft=False, stop_token_ids=())
    if ggufs:
        from llamacpp import build_llamacpp, llama_bench

        bins = build_llamacpp()[1]
    ms: dict[str, list[float]] = {k: [] for k in entries}
    cpu: dict[str, list[float]] = {k: [] for k in entries}
    load = [os.getloadavg()[0]]
    for _ in range(a.rounds):
        for k in entries:
            if k in ggufs:
                c0 = user_s(resource.RUSAGE_CHILDREN)
                llama_bench(bins, ggufs[k], a.threads, n=SHORT, depth=a.depth)
                c1 = user_s(resource.RUSAGE_CHILDREN)
                ms[k].append(llama_bench(bins, ggufs[k], a.threads, n=SHORT + a.tokens, depth=a.depth)["ms_per_token"])
                cpu[k].append(((user_s(resource.RUSAGE_CHILDREN) - c1) - (c1 - c0)) / a.tokens * 1e3)
            else:
                c0 = user_s()
                generate(backends[k], prompt, SHORT, draft=False, stop_token_ids=())
                c1 = user_s()
                g = generate(backends[k], prompt, SHORT + a.tokens, draft=False, stop_token_ids=())
                cpu[k].append(((user_s() - c1) - (c1 - c0)) / a.tokens * 1e3)
                ms[k].append(g.decode_s / (len(g.tokens) - 1) * 1e3)
    load.append(os.getloadavg()[0])
    print(json.dumps({"machine": machine(), "threads": a.threads, "depth": a.depth, "tokens": a.tokens, "cpus": a.cpus,
                      "load": [round(x, 1) for x in load],
                      "step_ms_best": {k: round(min(v), 1) for k, v in ms.items()},
                      "step_ms_median": {k: round(statistics.median(v), 1) for k, v in ms.items()},
                      "cpu_ms_median": {k: round(statistics.median(v), 1) for k, v in cpu.items()},
                      "rounds": {k: [round(x, 1) for x in v] for k, v in ms.items()},
                      "cpu_rounds": {k: [round(x, 1) for x in v] for k, v in cpu.items()}}))


if __name__ == "__main__":
    main()
