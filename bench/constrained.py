"""What constrained decoding costs (serve's response_format and forced tool calls): the loop under a
grammar vs free, on the shipped demo pair, speculative and plain, interleaved in one process.

    OMP_WAIT_POLICY=PASSIVE nice -n 10 .venv/bin/python bench/constrained.py --work /tmp/cbench [--repeats 3]

Variants, each on its own backend (1 thread) and, speculative, with serve's default `--speculation
auto` controller (drafting only while it pays), every prompt through each in rotating order:
  free    no constraint
  any     a grammar that allows any text: the same tokens as free, so its rate is the engine's
          and the loop's overhead alone (a mask check per emitted token, the logits fetched)
  json    a JSON schema (an object of a name, a count and a list of tags): the demo target, a
          Python model, writes JSON under the mask; its tokens differ from free's, and so does
          the drafter's acceptance
Rates: tokens over the rounds' wall time (decode, prefill excluded). Ratios per repeat against
free, then their median; the mean acceptance length (tokens per drafted round) beside them, since
json's speculative rate follows its acceptance. The grammar engine's own time (llguidance's calls: the mask check of
each token, a full mask where the target's choice is not allowed, consuming the token) is timed
per emitted token. Writes bench/results/constrained.json (`--out`), with the machine and the load before and after.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "count", "tags"], "additionalProperties": False}


class Timed:
    """A Constraint whose calls are timed (the grammar engine's share of a token)."""

    def __init__(self, c):
        self.c, self.s = c, 0.0

    def _t(self, f, *a):
        t0 = time.perf_counter()
        try:
            return f(*a)
        finally:
            self.s += time.perf_counter() - t0

    def accepts(self, t):
        return self._t(self.c.accepts, t)

    def allowed(self):
        return self._t(self.c.allowed)

    def consume(self, t):
        return self._t(self.c.consume, t)

    def rollback(self, n):
        return self._t(self.c.rollback, n)


def demo(work: Path):
    from dflash_export.export.artifact import export_artifact
    from dflash_export.serve.text import load_tokenizer

    out = work / "demo-out"
    if not (out / "manifest.json").is_file():
        export_artifact(ROOT / "demo/pair/target", ROOT / "demo/pair/draft", out, force=True, progress=False)
    tok = load_tokenizer(out)
    ps = [tok.encode(json.loads(x)["prompt"]).ids for x in (ROOT / "demo/prompts.jsonl").read_text().splitlines()
          if x.strip()][:8]
    return out, tok, ps


def main() -> None:
    from common import parser

    ap = parser(__doc__, out="constrained.json", json_flag=False)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    from common import machine, uptime, write_report

    from dflash_export.runtime.controller import controller_for
    from dflash_export.runtime.loop import Request, generate_batch
    from dflash_export.runtime.settings import load_settings
    from dflash_export.runtime.ort.backend import OrtBackend
    from dflash_export.serve.formats import Format
    from dflash_export.serve.grammar import Grammars, grammar

    out, tok, prompts = demo(a.work)
    report = {"machine": machine(), "load_before": uptime(), "prompts": len(prompts), "new": a.new,
              "repeats": a.repeats, "modes": {}}
    backends = {k: OrtBackend(out, threads=1) for k in ("free", "any", "json")}
    m = backends["free"].manifest
    eos = tuple(m.eos_token_ids)
    g = Grammars(tok, m.vocab_size, eos)
    grammars = {"any": g.compile("start: /(.|\\n)*/\n"), "json": g.compile(grammar(Format("none"), False, None, False,
                                                                                   SCHEMA))}
    names = list(backends)
    costs = load_settings(out, "ort:cpu").costs
    for draft in (True, False):
        per = {k: [] for k in names}
        engine = {k: [0.0, 0] for k in ("any", "json")}  # grammar seconds, tokens
        taus = {k: [] for k in names}  # tokens per drafted round of each generation
        control = {k: controller_for("auto", costs, m.block_size) if draft else None for k in names}
        for rep in range(a.repeats):
            acc = {k: [0, 0.0] for k in names}
            for i, p in enumerate(prompts):
                for k in names[(i + rep) % 3:] + names[: (i + rep) % 3]:
                    c = Timed(g.constraint(grammars[k], eos)) if k != "free" else None
                    (gen,), _ = generate_batch(backends[k], [Request(p, a.new, stop_token_ids=eos, constraint=c)],
                                               draft=draft, control=control[k])
                    acc[k][0] += len(gen.tokens) - 1
                    acc[k][1] += gen.decode_s
                    taus[k].append(gen.tau)
                    if c is not None:
                        engine[k][0] += c.s
                        engine[k][1] += len(gen.tokens)
            for k in names:
                per[k].append(acc[k][0] / acc[k][1])
        mode = "speculative" if draft else "plain"
        report["modes"][mode] = {
            "tokens_per_s": {k: statistics.median(v) for k, v in per.items()},
            "ratio_vs_free": {k: statistics.median(x / f for x, f in zip(per[k], per["free"])) for k in ("any", "json")},
            "grammar_us_per_token": {k: 1e6 * s / max(n, 1) for k, (s, n) in engine.items()},
            "mean_acceptance_length": {k: statistics.mean(v) for k, v in taus.items()},
        }
        print(mode, json.dumps(report["modes"][mode]), flush=True)
    write_report(report, a.out)


if __name__ == "__main__":
    main()
