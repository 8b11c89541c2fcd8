"""What log-probabilities cost: the loop with `logprobs=5` vs without, and without vs an older
version of the loop (the runtime of a git revision, default `main`), interleaved in one process.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/logprobs.py --work /tmp/lpbench [--old main] [--repeats 3]

Two models: the shipped demo pair (exported once into WORK/demo-out) and a random-weight
Qwen3-style target with Qwen3's 151,936-token vocabulary (hidden 512, 4 layers, 4 heads / 2 KV
heads of 128, intermediate 1536, tied head; a random 1-layer drafter: it accepts nothing, so a
speculative round emits one token from a full-block verify). Its LM head is narrower than the
0.6B shape's (512 vs 1024 wide), so the host-side log-softmax over 152k logits weighs about
twice as much against the graph calls as it would there.

Per model and mode (speculative, plain), each repeat runs every prompt through three variants
in rotating order, each on its own backend (1 thread): `old` (the older revision's loop),
`off` (this loop, no logprobs), `on` (this loop, logprobs with 5 alternatives per token).
Rates: tokens over the wall time of whole requests (prefill included) and over the rounds
alone. Ratios per repeat, then their median. Prints one JSON object per model and mode.

`--serve`: the same through `dflash-export serve` (its default batch, one request at a time
over HTTP, non-streamed completions at temperature 0): `logprobs: 5` vs none, alternating per
prompt, so the server's formatting of the log-probabilities (token texts, dicts) is included.
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def old_runtime(rev: str, work: Path):
    """The runtime package of git revision `rev`, importable as `dflash_old.runtime` (its modules
    import each other relatively); returns (its loop module, its OrtBackend, the commit)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    pkg = work / f"old-{commit[:10]}" / "dflash_old"
    if not (pkg / "runtime").is_dir():
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("")
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "runtime"], capture_output=True, check=True).stdout
        tarfile.open(fileobj=io.BytesIO(tar)).extractall(pkg)
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("dflash_old.runtime.loop"), importlib.import_module("dflash_old.runtime.ort").OrtBackend, commit


def demo_artifact(work: Path) -> tuple[Path, list[list[int]]]:
    from dflash_export.export.artifact import export_artifact
    from dflash_export.serve.text import load_tokenizer

    out = work / "demo-out"
    if not (out / "manifest.json").is_file():
        export_artifact(ROOT / "demo/pair/target", ROOT / "demo/pair/draft", out, force=True, progress=False)
    tok = load_tokenizer(out)
    ps = [tok.encode(json.loads(x)["prompt"]).ids for x in (ROOT / "demo/prompts.jsonl").read_text().splitlines()
          if x.strip()][:8]
    return out, ps


def vocab_artifact(work: Path) -> tuple[Path, list[list[int]]]:
    from common import make_checkpoint

    from dflash_export.export.artifact import export_artifact

    out, src = work / "v152k-out", work / "v152k"
    if not (out / "manifest.json").is_file():
        if not (src / "target" / "config.json").is_file():
            make_checkpoint(src, 151936, 512, 4, 1536, heads=4, kv_heads=2, tie=True)
        export_artifact(src / "target", src / "draft", out, max_context=512, force=True, progress=False)
    if not (out / "tokenizer.json").is_file():  # the server needs one: a word per id ("t0 t1 ..."), for --serve
        from tokenizers import Tokenizer, models, pre_tokenizers

        from dflash_export.runtime import manifest as M

        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(151936)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(out / "tokenizer.json"))
        m = M.load_manifest(out, verify=False)
        m.tokenizer = True
        M.write_manifest(out, m)
    rng = np.random.default_rng(0)
    return out, [rng.integers(0, 151000, 32).tolist() for _ in range(4)]


def run(variants: dict, prompts: list, new: int, draft: bool, repeats: int) -> dict:
    from dflash_export.runtime.logprobs import Logprobs

    names = list(variants)
    per = {k: [] for k in names}  # per repeat: (tokens, wall s, decode tokens, decode s)
    for rep in range(repeats):
        acc = {k: [0, 0.0, 0, 0.0] for k in names}
        for i, p in enumerate(prompts):
            order = names[(i + rep) % len(names):] + names[: (i + rep) % len(names)]
            for k in order:
                gen, be = variants[k]
                kw = {"logprobs": Logprobs(5)} if k == "on" else {}
                t0 = time.perf_counter()
                g = gen(be, p, new, draft, kw)
                wall = time.perf_counter() - t0
                a = acc[k]
                a[0] += len(g.tokens)
                a[1] += wall
                a[2] += len(g.tokens) - 1
                a[3] += g.decode_s
        for k in names:
            per[k].append(acc[k])
    rate = {k: [a[0] / a[1] for a in v] for k, v in per.items()}
    drate = {k: [a[2] / a[3] for a in v] for k, v in per.items()}

    def ratio(r, a, b):
        return round(statistics.median(x / y for x, y in zip(r[a], r[b])), 3)

    return {"tokens_per_s": {k: round(max(v), 1) for k, v in rate.items()},
            "decode_tokens_per_s": {k: round(max(v), 1) for k, v in drate.items()},
            "on_over_off": ratio(rate, "on", "off"), "off_over_old": ratio(rate, "off", "old"),
            "decode_on_over_off": ratio(drate, "on", "off"), "decode_off_over_old": ratio(drate, "off", "old")}


def serve_run(out: Path, prompts: list, new: int, repeats: int) -> dict:
    """Alternating logprobs 5 / none per prompt through a real server; tokens/s per variant per repeat."""
    proc = subprocess.Popen([str(Path(sys.executable).parent / "dflash-export"), "serve", str(out), "--port", "0", "--threads", "1",
                             "--no-access-log"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = None
        for line in proc.stdout:
            if m := re.search(r"ready at http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        assert port, "the server did not start"

        def post(body):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = json.loads(c.getresponse().read())
            c.close()
            return r

        rates = {"off": [], "on": []}
        post({"prompt": prompts[0], "max_tokens": 4, "temperature": 0})  # warm up
        for rep in range(repeats):
            acc = {k: [0, 0.0] for k in rates}
            for i, p in enumerate(prompts):
                for k in (("off", "on") if (i + rep) % 2 == 0 else ("on", "off")):
                    body = {"prompt": p, "max_tokens": new, "temperature": 0, "stop_token_ids": []}
                    if k == "on":
                        body["logprobs"] = 5
                    t0 = time.perf_counter()
                    r = post(body)
                    acc[k][1] += time.perf_counter() - t0
                    acc[k][0] += r["usage"]["completion_tokens"]
            for k in rates:
                rates[k].append(acc[k][0] / acc[k][1])
    finally:
        proc.terminate()
        proc.wait(60)
    return {"tokens_per_s": {k: round(max(v), 1) for k, v in rates.items()},
            "on_over_off": round(statistics.median(a / b for a, b in zip(rates["on"], rates["off"])), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--old", default="main", help="git revision whose runtime is the `old` variant")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="demo,v152k")
    ap.add_argument("--serve", action="store_true", help="also through the server (logprobs 5 vs none)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    old_loop, OldBackend, commit = old_runtime(args.old, args.work)
    from dflash_export.runtime.loop import Request, generate_batch
    from dflash_export.runtime.ort.backend import OrtBackend

    def new_gen(be, p, n, draft, kw):
        (g,), _ = generate_batch(be, [Request(p, n, stop_token_ids=(), **kw)], draft=draft)
        return g

    def old_gen(be, p, n, draft, kw):  # the same entry point as new_gen
        (g,), _ = old_loop.generate_batch(be, [old_loop.Request(p, n, stop_token_ids=())], draft=draft)
        return g

    load = Path("/proc/loadavg").read_text().split()[:3]
    for name in args.models.split(","):
        out, ps = demo_artifact(args.work) if name == "demo" else vocab_artifact(args.work)
        new = 64 if name == "demo" else 24
        variants = {"old": (old_gen, OldBackend(out, threads=1)), "off": (new_gen, OrtBackend(out, threads=1)),
                    "on": (new_gen, OrtBackend(out, threads=1))}
        if args.serve:
            r = serve_run(out, ps, new, args.repeats)
            print(json.dumps({"model": name, "mode": "serve, speculative", "prompts": len(ps), "new_tokens": new,
                              "repeats": args.repeats, "load": Path("/proc/loadavg").read_text().split()[:3], **r}),
                  flush=True)
        for draft in (True, False):
            r = run(variants, ps, new, draft, args.repeats)
            print(json.dumps({"model": name, "mode": "speculative" if draft else "plain", "prompts": len(ps),
                              "new_tokens": new, "repeats": args.repeats, "old": f"{args.old} {commit[:10]}",
                              "load_before": load, "load_after": Path("/proc/loadavg").read_text().split()[:3], **r}),
                  flush=True)


if __name__ == "__main__":
    main()
