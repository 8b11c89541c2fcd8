"""Streamed text: the time to turn a completion's tokens into SSE deltas, round by round, as the
server does (serve/text.py TextStream over the demo pair's tokenizer), for growing completions.
Per-token cost that stays flat with the length means the text is decoded incrementally; one that
grows with it means the whole completion is decoded again each round.

    .venv/bin/python bench/stream_text.py --tokens 2000 16000 --round 4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from dflash_export.serve.text import TextStream

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000, 16000])
    ap.add_argument("--round", type=int, default=4, help="tokens per round (a speculative round accepts several)")
    ap.add_argument("--stop", default="\n\n\n\n\n", help="a stop string that never matches (its search is part of the cost)")
    a = ap.parse_args()
    tok = Tokenizer.from_file(str(ROOT / "demo/pair/target/tokenizer.json"))
    text = (ROOT / "README.md").read_text() * 20
    ids = tok.encode(text).ids
    for n in a.tokens:
        completion = (ids * (n // len(ids) + 1))[:n]
        ts, t0 = TextStream(tok, [a.stop]), time.perf_counter()
        out = [ts.push(completion[i : i + a.round]) for i in range(0, n, a.round)]
        out.append(ts.finish())
        took = time.perf_counter() - t0
        assert "".join(out) == tok.decode(completion, skip_special_tokens=True)
        print(f"{n} tokens, {a.round} per round: {took:.3f} s ({1e6 * took / n:.1f} us/token)")


if __name__ == "__main__":
    main()
