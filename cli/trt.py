"""`dflash-export build`: TensorRT engines for an exported directory.

Without TensorRT the command stops at once with one line naming the package to install
(nothing is read or written). `--dry-run` needs no TensorRT: it runs the compatibility
lint and prints the build plan.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import
from ..runtime.manifest import load_manifest

# TensorRT, polygraphy and onnx: only when the command runs (runtime/lazy.py)
trt_engines = lazy_import("dflash_export.runtime.trt.engines")
trt_build = lazy_import("dflash_export.export.trt_build")
trt_lint = lazy_import("dflash_export.export.trt_lint")


@click.command("build")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="Must equal the export's dtype (the default): engines are strongly typed; for another "
                   "precision re-export with `export --dtype`.")
@click.option("--max-context", type=int, default=None, help="Longest sequence the engines accept (default: the export's).")
@click.option("--max-prompt", type=int, default=None, help="Longest prefill chunk (default: max context / 2).")
@click.option("--max-batch", type=int, default=1, show_default=True,
              help="Rows per call the engines take (profiles batch 1..N; ragged exports only): "
                   "`generate/bench --backend trt --batch N` up to it.")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="Timing cache file reused across builds (default: ~/.cache/dflash-export/trt-timing.cache).")
@click.option("--workspace", type=float, default=4.0, show_default=True, help="Builder workspace limit in GB.")
@click.option("--dry-run", is_flag=True, help="Lint the graphs for the supported TensorRT range and print the plan; build nothing (no TensorRT needed).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def build(out: Path, precision, max_context, max_prompt, max_batch, timing_cache, workspace, dry_run, no_progress) -> None:
    """Build TensorRT engines for OUT into OUT/engines and record them in its manifest.

    Needs an NVIDIA GPU and TensorRT 10.12 to 11.x (the trt extra); --dry-run needs neither.
    Takes exports with standard attention, not quantized ones.

    \b
    target        profile 0 verify (seq 1..block size), profile 1 prefill (seq 1..max prompt)
    draft_context profile over the new-context length
    draft_block   block fixed at K, profile over the past-context length and the drafts its head scores
    Engines are strongly typed (the export's dtype decides precision) and run only with the
    same TensorRT version on the same GPU architecture.
    """
    if dry_run:
        manifest = load_manifest(out)
        plan = trt_build.build_plan(manifest, precision, max_context, max_prompt, workspace, max_batch)
        for w in trt_lint.check(out, manifest, limits=plan.limits):
            click.echo(f"warning: {w}", err=True)
        click.echo(f"lint: every graph passes the TensorRT {trt_lint.lint_range()} checks (operators, types, shapes)")
        click.echo(trt_build.describe(plan))
        return
    trt_engines.import_tensorrt()  # fail fast, before touching OUT
    if workspace <= 0:
        raise DFlashError(f"--workspace {workspace}: give the builder's workspace in GB, > 0")
    trt_build.build_engines(out, precision, max_context, max_prompt, timing_cache, workspace, progress=not no_progress,
                            echo=click.echo, max_batch=max_batch)


COMMANDS = [build]
