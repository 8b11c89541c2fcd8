"""Write demo/prompts-offdomain.jsonl: prompts off the demo drafter's domain (Python code).

Serving benchmarks (NVIDIA's aiperf, guidellm) load a server with synthetic prompts; this is
the simplest of them: 128 token ids drawn uniformly from the target's vocabulary (special
tokens left out) with numpy's default_rng(SEED), decoded to text by the target's tokenizer.
`dflash-export bench` and `dflash-export demo` report speed on these beside the code prompts.

    python tools/offdomain_prompts.py            # rewrites demo/prompts-offdomain.jsonl (deterministic)
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from dflash_export.runtime.measure import random_text_prompts

SEED, N, LENGTH = 0, 24, 128
ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    tok = Tokenizer.from_file(str(ROOT / "demo" / "pair" / "target" / "tokenizer.json"))
    prompts = random_text_prompts(tok, tok.get_vocab_size(), N, LENGTH, SEED)
    out = ROOT / "demo" / "prompts-offdomain.jsonl"
    out.write_text("".join(json.dumps({"prompt": p, "source": f"random vocabulary, seed {SEED}, {LENGTH} tokens"}) + "\n"
                           for p in prompts))
    print(f"{out}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
