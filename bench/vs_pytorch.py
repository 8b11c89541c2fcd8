"""The ORT speculative loop against PyTorch eager, on the same weights, in one run.

Three ways to produce the same greedy tokens from the benchmark pair (bench/common.py):
  ort         runtime.loop over the exported graphs (this project's product)
  torch-spec  models.speculative_generate: the same algorithm in PyTorch eager
  hf          transformers' generate (greedy, no drafter) on the target checkpoint
plus the ORT autoregressive baseline. All timings are end to end (prefill included),
interleaved per prompt, and every output is checked to be identical.

    python bench/vs_pytorch.py [--prompts 3] [--prompt-len 32] [--max-new-tokens 64] [--threads 1] [--model small|wide] [--json]
    python bench/vs_pytorch.py --pair T D [--export OUT] --prompts-file demo/prompts.jsonl [--verify auto|full]
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from common import bench_model, export_pair, machine, parser, random_prompts


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for ORT and torch alike")
    ap.add_argument("--model", default="small", help="bench/common.py BENCH_MODELS: small | wide")
    ap.add_argument("--pair", nargs=2, metavar=("TARGET", "DRAFT"), help="bench this (trained) pair instead")
    ap.add_argument("--export", help="with --pair: this exported directory of the pair (e.g. calibrated by "
                                     "bench --calibrate, or exported with --attention ort) instead of a cached export")
    ap.add_argument("--prompts-file", help="JSONL with a 'prompt' text field per line (needs the pair's tokenizer)")
    ap.add_argument("--verify", choices=("auto", "full"), default="auto",
                    help="ORT loop: auto = the policy in the export's runtime.json (bench --calibrate), else full")
    a = ap.parse_args()

    import torch
    from dflash_export.models.tiny import hf_model

    from dflash_export.models import Drafter, Target, speculative_generate
    from dflash_export.models.draft_config import DraftConfig
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.ort.backend import OrtBackend

    torch.set_num_threads(a.threads)
    if a.pair:
        tdir, ddir = map(Path, a.pair)
        out = Path(a.export) if a.export else export_pair(tdir, ddir)
    else:
        tdir, ddir, out = bench_model(a.model)
    be = OrtBackend(out, threads=a.threads)
    m = be.manifest
    from dflash_export.runtime.settings import RunOptions, resolve

    policy = resolve(out, m, RunOptions(threads=a.threads, verify=a.verify)).verify
    dc = DraftConfig.load(ddir)
    target, drafter = Target.from_pretrained(tdir, dc.target_layer_ids), Drafter.from_pretrained(ddir)
    hf = hf_model(tdir)
    hf.generation_config.eos_token_id = None  # exactly max_new_tokens everywhere
    n = a.max_new_tokens

    def ort_spec(p):
        return generate(be, p, n, stop_token_ids=(), verify=policy)

    def ort_ar(p):
        return generate(be, p, n, stop_token_ids=(), draft=False)

    def torch_spec(p):
        return speculative_generate(target, drafter, p, n, mask_token_id=m.mask_token_id, block_size=m.block_size)

    def hf_greedy(p):
        with torch.inference_mode():
            return hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(p):].tolist()

    runs = {"ort": ort_spec, "ort-ar": ort_ar, "torch-spec": torch_spec, "hf": hf_greedy}
    if a.prompts_file:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        lines = [json.loads(x) for x in Path(a.prompts_file).read_text().splitlines() if x.strip()]
        prompts = [tok.encode(x["prompt"]).ids for x in lines[: a.prompts]]
        source = f"{len(prompts)} text prompts from {a.prompts_file}"
    else:
        prompts = random_prompts(a.prompts, a.prompt_len, m.vocab_size)
        source = f"{a.prompts} random prompts x {a.prompt_len} tokens"
    for f in runs.values():  # warm up every path once
        f(prompts[0])
    wall = {k: 0.0 for k in runs}
    tokens = {k: [] for k in runs}
    taus = []
    for p in prompts:
        for k, f in runs.items():
            t = time.perf_counter()
            r = f(p)
            wall[k] += time.perf_counter() - t
            tokens[k].append(r if isinstance(r, list) else r.tokens)
            if k == "ort":
                taus += r.acceptance_lengths
    same = all(tokens[k] == tokens["ort"] for k in runs)
    tps = {k: a.prompts * n / wall[k] for k in runs}
    report = {
        "machine": machine(),
        "model": f"{m.architecture} {m.target_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}, "
                 f"{m.draft_layers}-layer drafter, block {m.block_size} " + (f"(pair {tdir.name}, {ddir.name})" if a.pair else "(random weights)"),
        "prompts": source, "max_new_tokens": n,
        "threads": {"ort": a.threads, "torch": torch.get_num_threads()},
        "ort_verify": "full" if policy is None else {"theta": policy.theta, "min_len": policy.min_len},
        "export": str(out),
        "tau": sum(taus) / len(taus),
        "tokens_per_second": tps,
        "ort_vs_torch_spec": tps["ort"] / tps["torch-spec"],
        "ort_vs_hf_generate": tps["ort"] / tps["hf"],
        "ort_ar_vs_hf_generate": tps["ort-ar"] / tps["hf"],
        "identical_tokens": same,
    }
    if a.json:
        print(json.dumps(report))
        return
    print(report["model"])
    print(f"{source}, {n} new tokens, end to end, {a.threads} thread(s); "
          f"tau {report['tau']:.2f}")
    for k, v in tps.items():
        print(f"  {k:<11} {v:8.1f} tok/s")
    print(f"ORT speculative vs PyTorch speculative (same algorithm): {report['ort_vs_torch_spec']:.2f}x")
    print(f"ORT speculative vs transformers generate:               {report['ort_vs_hf_generate']:.2f}x")
    print(f"ORT autoregressive vs transformers generate:            {report['ort_ar_vs_hf_generate']:.2f}x")
    print(f"identical tokens on all paths: {same}")


if __name__ == "__main__":
    main()
