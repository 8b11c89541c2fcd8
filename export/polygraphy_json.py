"""`check --save-polygraphy`: both sides' tensors as Polygraphy JSON, so `polygraphy run` can replay a case."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..runtime.lazy import lazy_import

# polygraphy, on first use (runtime/lazy.py): inside write_polygraphy's redirect, since it logs to stdout
comparator = lazy_import("polygraphy.comparator")
pstruct = lazy_import("polygraphy.comparator.struct")
pjson = lazy_import("polygraphy.json")


def write_polygraphy(directory: Path, saved) -> None:
    """Per graph and regime: <graph>.<case>.inputs.json (a list of feed dicts, as
    `polygraphy run --load-inputs` reads) and .outputs.json (RunResults with a `pytorch`
    and an `onnxruntime` runner, for `--load-outputs`)."""
    with contextlib.redirect_stdout(sys.stderr):  # Polygraphy logs to stdout; keep --json's stdout clean
        directory.mkdir(parents=True, exist_ok=True)
        for graph, case, feeds, ref, got in saved:
            stem = f"{graph}.{case.replace(' ', '_').replace('=', '')}"
            pjson.save_json([feeds], str(directory / f"{stem}.inputs.json"))
            results = comparator.RunResults()
            results.append(("pytorch", [pstruct.IterationResult(ref, runner_name="pytorch")]))
            results.append(("onnxruntime", [pstruct.IterationResult(got, runner_name="onnxruntime")]))
            results.save(str(directory / f"{stem}.outputs.json"))
