"""int4 / int8 block size, symmetry and head bits against error, on the one trained target the project ships (CPU).

Random-weight checkpoints (the real-shape benches) say little about rounding error: their logits
are near uniform. The demo pair's target (demo/pair, Qwen3 layout, hidden 256, 6 layers, trained
on Python code) is a real weight distribution, and its hidden and intermediate sizes divide into
blocks of 16 to 128. This exports it once (fp32, `--attention ort`), quantizes it at each
--scheme and --blocks size, symmetric and with zero points (linear layers, LM head and lookup, as
a CPU user would; the head and lookup at each of --head-bits), and teacher-forces real text
through each: the demo prompts followed by the float model's own greedy continuation (--new
tokens). Against the float export, per variant and MatMulNBits accuracy level (0: fp32
activations, 4: int8 activations, what `auto` picks on x86): logits' mean absolute error, top-1
agreement, KL(float || quantized) per position, and the mean negative log-likelihood of the text.

    python bench/quant_blocks.py [--work /tmp/dflash-quant-blocks] [--scheme int4,int8] [--blocks 16,32,64,128]
        [--head-bits 4,8] [--symmetric-only] [--prompts 12] [--new 64] [--json]

Speed is the other half of the trade: bench/step_ms.py on exports of a real shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common import ROOT, machine, parser


def logsoftmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logits(backend, seq: np.ndarray) -> np.ndarray:
    backend.reset()
    out = backend.target(seq, want_logits=True).logits.astype(np.float64)
    backend.commit(0)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-quant-blocks"))
    ap.add_argument("--scheme", default="int4", help="comma-separated: int4, int8")
    ap.add_argument("--blocks", default="16,32,64,128")
    ap.add_argument("--head-bits", default="", help="comma-separated bits of the head and lookup (default: the scheme's)")
    ap.add_argument("--symmetric-only", action="store_true", help="no zero-point variants")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new", type=int, default=64, help="float greedy tokens appended to each prompt")
    a = ap.parse_args()
    from tokenizers import Tokenizer

    from dflash_export.export import accuracy_level as AL
    from dflash_export.export.artifact import export_artifact
    from dflash_export.export.quantize import QuantOptions, quantize_artifact
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.ort.backend import OrtBackend

    pair = ROOT / "demo" / "pair"
    base = a.work / "fp32"
    a.work.mkdir(parents=True, exist_ok=True)
    if not (base / "manifest.json").is_file():
        export_artifact(pair / "target", pair / "draft", base, max_context=1024, attention="ort", force=True, progress=False)
    variants = {}
    heads = [int(b) for b in a.head_bits.split(",") if b] or [None]
    for scheme, block, head, symmetric in ((s, int(b), h, sym) for s in a.scheme.split(",") for b in a.blocks.split(",")
                                           for h in heads for sym in ((True,) if a.symmetric_only else (True, False))):
        q = QuantOptions(scheme, block, symmetric, lm_head=True, embedding=True, accuracy_level=0, head_bits=head)
        out = a.work / f"{scheme}-b{block}{f'-h{q.head().bits}' if q.head() is not q else ''}{'' if symmetric else '-zp'}"
        if out.name in variants:
            continue
        if not (out / "manifest.json").is_file():
            quantize_artifact(base, out, q, force=True, progress=False)
        variants[out.name] = (block, symmetric, out)
    tok = Tokenizer.from_file(str(pair / "target" / "tokenizer.json"))
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(ln)["prompt"] for ln in lines if ln.strip()][: a.prompts]
    ref_backend = OrtBackend(base, drafter=False)
    seqs = []
    for p in prompts:
        ids = tok.encode(p).ids[-(1000 - a.new):]
        g = generate(ref_backend, ids, a.new, draft=False, stop_token_ids=())
        seqs.append(np.array(ids + list(g.tokens), np.int64))
    ref = [logits(ref_backend, s) for s in seqs]
    ref_backend.close()
    nll = lambda lp, s: -lp[np.arange(len(s) - 1), s[1:]]  # noqa: E731
    rows = [{"variant": "fp32", "nll": float(np.mean(np.concatenate([nll(logsoftmax(r), s) for r, s in zip(ref, seqs)])))}]
    for name, (block, symmetric, out) in variants.items():
        for level in (0, 4):
            AL.set_level(out, level)  # rewrites the graphs: read without the manifest's hashes below
            b = OrtBackend(out, drafter=False, verify=False)
            err, agree, kl, nl = [], [], [], []
            for r, s in zip(ref, seqs):
                o = logits(b, s)
                lp, lq = logsoftmax(r), logsoftmax(o)
                err.append(np.abs(o - r).mean())
                agree.append(np.mean(o.argmax(-1) == r.argmax(-1)))
                kl.append(np.mean((np.exp(lp) * (lp - lq)).sum(-1)))
                nl.append(nll(lq, s))
            b.close()
            rows.append({"variant": name, "block": block, "symmetric": symmetric, "accuracy_level": level,
                         "logits_mean_abs_err": float(np.mean(err)), "top1_agreement": float(np.mean(agree)),
                         "kl": float(np.mean(kl)), "nll": float(np.mean(np.concatenate(nl)))})
    if a.json:
        print(json.dumps({"machine": machine(), "positions": int(sum(len(s) for s in seqs)), "rows": rows}))
        return
    print(f"demo target, {len(seqs)} texts, {sum(len(s) for s in seqs)} positions; fp32 NLL {rows[0]['nll']:.4f}")
    print(f"{'variant':18s} level  logits err  top-1 agree  KL        NLL")
    for r in rows[1:]:
        print(f"{r['variant']:18s} {r['accuracy_level']:5d}  {r['logits_mean_abs_err']:10.4f}  {r['top1_agreement']:11.4f}  "
              f"{r['kl']:.5f}  {r['nll']:.4f}")


if __name__ == "__main__":
    main()
