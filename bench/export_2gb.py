"""Export a target whose weights exceed protobuf's 2 GB limit, then load it in ONNX Runtime.

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python bench/export_2gb.py --work /tmp/big2gb

Three child processes, so each one's peak RSS is its own:
1. write a random fp32 Qwen3 checkpoint straight with safetensors (one shard per tensor
   group, no transformers model), plus a 1-layer drafter;
2. `export_artifact` (load, trace, save, validate, manifest): time and peak RSS;
3. the ONNX Runtime backend (runtime/ort/backend.py, as `generate` runs it): load the three
   graphs (shared embedding and LM head read once, handed to both sessions) and decode 8
   tokens with the runtime loop: time and peak RSS.
The goal is an export whose peak RSS is at most 2.5x the weights' bytes. Prints one JSON
object. Not part of the test suite (minutes, several GB of RAM and disk).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import make_checkpoint, peak_rss_bytes, run_child


def do_export(work: Path) -> dict:
    from dflash_export.export.artifact import export_artifact

    t0 = time.perf_counter()
    export_artifact(work / "target", work / "draft", work / "out", max_context=1024, force=True, progress=True)
    return {"export_s": round(time.perf_counter() - t0, 1), "export_peak_rss": peak_rss_bytes()}


def do_load(work: Path, low_memory: bool = False) -> dict:
    import numpy as np

    from dflash_export.runtime.manifest import load_manifest
    from dflash_export.runtime.loop import generate
    from dflash_export.runtime.ort.backend import OrtBackend

    t0 = time.perf_counter()
    load_manifest(work / "out")  # sha256 of every file
    t1 = time.perf_counter()
    backend = OrtBackend(work / "out", verify=False, low_memory=low_memory)  # the runtime users run
    t2 = time.perf_counter()
    g = generate(backend, [int(x) for x in np.arange(8) * 7 + 3], 8, stop_token_ids=())
    return {"low_memory": low_memory, "verify_manifest_s": round(t1 - t0, 1), "ort_load_s": round(t2 - t1, 1),
            "generate_8_tokens_s": round(time.perf_counter() - t2, 1), "ort_peak_rss": peak_rss_bytes(),
            "tokens": g.tokens}


def child(step: str, work: Path, args) -> dict:
    return run_child(__file__, ["--step", step, "--work", str(work), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
                                "--layers", str(args.layers), "--intermediate", str(args.intermediate)]
                     + (["--low-memory"] if args.low_memory else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-export-2gb"))
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--low-memory", action="store_true", help="load with OrtBackend(low_memory=True): no prepacked LM head copies")
    ap.add_argument("--step", choices=["checkpoint", "export", "load"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step == "checkpoint":
        make_checkpoint(args.work, args.vocab, args.hidden, args.layers, args.intermediate)
        print(json.dumps({}))
        return
    if args.step:
        print(json.dumps(do_export(args.work) if args.step == "export" else do_load(args.work, args.low_memory)))
        return

    import shutil

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    child("checkpoint", args.work, args)
    weights = sum(p.stat().st_size for p in (args.work / "target").glob("*.safetensors"))
    result = {"target_weight_bytes": weights, **child("export", args.work, args), **child("load", args.work, args)}
    out = args.work / "out"
    result["files"] = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    result["export_peak_rss_over_weights"] = round(result["export_peak_rss"] / weights, 2)
    result["ort_peak_rss_over_weights"] = round(result["ort_peak_rss"] / weights, 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
