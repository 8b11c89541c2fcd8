"""`export` (target + drafter -> ONNX artifact directory), `quantize` and `check` (parity vs PyTorch).

The export stages (torch, onnx) are named with lazy_import and imported when a command runs, so `--help` is instant.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from rich.console import Console
from rich.table import Table

from .options import field_options, model_options, num_prompts_option
from ..export.options import ExportOptions, QuantRequest
from ..runtime import outdir
from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import
from ..runtime.manifest import load_manifest
from ..serve.text import load_tokenizer
from .run import read_prompts

export_artifact = lazy_import("dflash_export.export.artifact")  # torch, onnx: only when a command runs
export_check = lazy_import("dflash_export.export.check")
export_quantize = lazy_import("dflash_export.export.quantize")
Q = lazy_import("dflash_export.export.quant_options")  # light (no torch, onnx): the checks made before anything loads
sources = lazy_import("dflash_export.export.sources")  # huggingface_hub ids resolved when a command runs


@click.command()
@model_options(required=True)
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@field_options(ExportOptions, into="options")
@field_options(QuantRequest, into="quant")
def export(target_dir, revision, draft_dir, draft_revision, out_dir, options: ExportOptions, quant: QuantRequest):
    """Trace a target and its DFlash drafter to ONNX: target.onnx, draft_context.onnx,
    draft_block.onnx, their external weights (weights several graphs hold stored once, in
    shared.data), the tokenizer files and manifest.json with the sha256 of every file and
    where the pair came from (id, revision and commit, or directory; the weight files' sha256).

    The export is atomic: it is written next to --out and renamed at the end, so a failed
    or interrupted export leaves nothing behind (a folder left by a killed one is removed by
    the next export to the same place). It first checks that free memory and disk can hold
    the model and stops with a hint when they cannot. The graphs are validated (onnx.checker,
    shape inference, standard-operator lint, ONNX Runtime load) before the rename.

    \b
    Examples:
      dflash-export export --target Qwen3-8B --draft Qwen3-8B-DFlash --out art
      dflash-export export --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16@<commit> --out art
      dflash-export export --target t --draft d --out art --dtype fp16 --block-size 8
      dflash-export export --target t --draft d --out art --force   # replace art
      dflash-export export --target t --draft d --out art4 --quantize int4 --quantize-draft
      dflash-export export --target t --draft d --out art --draft-vocab 32768 --draft-vocab-data corpus.jsonl
      dflash-export export --target Qwen3-30B-A3B --draft d --out art --moe standard   # TensorRT
      dflash-export export --target t --draft d --out art --attention ort --kv-cache int8
    """
    q = quant.options()
    if q is not None:  # these checks before anything loads (export_artifact repeats them)
        Q.check_options(q, options.dtype)
    Q.check_kv_cache(options.kv_cache, options.attention, options.kv_calibration)
    outdir.check_out_dir(out_dir.absolute(), options.force)
    target_dir = sources.resolve(target_dir, revision, "target")
    draft_dir = sources.resolve(draft_dir, draft_revision, "drafter")
    export_artifact.export_artifact(target_dir, draft_dir, out_dir, quantize=q, **dataclasses.asdict(options))


@click.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@field_options(QuantRequest, into="quant")
@click.option("--force", is_flag=True, help="Replace a non-empty --out directory (only once quantization succeeded).")
@click.option("--quiet", is_flag=True, help="No progress display.")
def quantize(src, out_dir, quant: QuantRequest, force, quiet):
    """Quantize the weights of an exported directory SRC (fp32 or fp16) into --out, without
    re-tracing: what `export --quantize` does after its float export (docs/quantization.md).

    \b
    Examples:
      dflash-export quantize art --out art-int4 --quantize int4
      dflash-export quantize art --out art-int8 --quantize int8 --quantize-draft --quantize-lm-head
      dflash-export quantize art --out art-d8 --quantize int8 --draft-only   # the target stays float
      dflash-export quantize art --out art-4h8 --quantize int4 --quantize-lm-head --quantize-embedding --quant-head-bits 8
    """
    q = quant.options()
    if q is None:
        raise DFlashError("quantize needs --quantize int4|int8")
    Q.check_options(q, load_manifest(src, verify=False).dtype)  # before anything loads (quantize_artifact repeats them)
    outdir.check_out_dir(out_dir.absolute(), force)
    export_quantize.quantize_artifact(src, out_dir, q, force=force, progress=not quiet)


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@model_options(required=False, target_help=" OUT was exported from [default: the one its manifest records]",
               draft_help=" OUT was exported from [default: the one its manifest records]")
@num_prompts_option(20, "Random prompts decoded end to end (ONNX Runtime vs the PyTorch oracle); 0 skips. "
                        "--prompts FILE decodes the file's prompts instead.")
@click.option("--max-new-tokens", type=int, default=24, show_default=True, help="Tokens per end-to-end prompt.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the random inputs and prompts.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--save-polygraphy", type=click.Path(path_type=Path),
              help="Write inputs and both sides' outputs as Polygraphy JSON into this directory.")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="ONNX Runtime execution provider for the exported side.")
@click.option("--reference", type=click.Choice(["auto", "whole", "by-layer"]), default="auto", show_default=True,
              help="How the PyTorch side holds its weights: whole in memory, or each matrix read from the checkpoint "
                   "when its layer runs (a model larger than memory, slower); auto: by-layer when whole would not fit.")
def check(out, target_dir, revision, draft_dir, draft_revision, num_prompts, prompts_file, max_new_tokens, seed, as_json, save_polygraphy, provider,
          reference):
    """Check an exported directory OUT against the PyTorch modules it came from.

    Runs every graph in ONNX Runtime (--provider, CPU by default) and in PyTorch on
    fresh random inputs: target
    prefill (past 0), a 1-token step and a K-token verify on a past; the drafter's context
    graph; the block graph with and without context. Prints max / mean / p99 absolute
    error per output against the tolerance (fp32: 1e-4 on logits, taps and K/V; ids
    exact). Then decodes --num-prompts random prompts (or the prompts of --prompts FILE) greedily
    through the graphs and through the PyTorch oracle: tokens and acceptance lengths must be identical.

    fp16/bf16 exports report the statistics and top-1 agreement without failing on fp32
    tolerances. Exit status 0 when everything passes, 1 otherwise (failing rows shown),
    2 when OUT is not a valid export (its files must match the manifest's sha256).

    A source larger than the memory left beside the graphs (an 8B target is 32 GB in
    fp32) is read layer at a time (--reference by-layer, chosen by auto): each matrix
    from the checkpoint when its layer runs, then freed; the same numbers, slower.

    Without --target / --draft it finds the pair the manifest records (the same Hugging Face
    id at the same commit, or the same directory); it warns when their weight files no
    longer match the manifest's record of them.

    \b
    Examples:
      dflash-export check art
      dflash-export check art --target Qwen3-8B --draft Qwen3-8B-DFlash
      dflash-export check art --target t --draft d --num-prompts 50 --json
      dflash-export check art --target t --draft d --prompts demo/prompts.jsonl --max-new-tokens 64
      dflash-export check art --target t --draft d --save-polygraphy pg
      dflash-export check art8b --num-prompts 3 --max-new-tokens 8 --reference by-layer
      polygraphy run art/target.onnx --onnxrt \\
          --load-inputs pg/target.prefill_P0_S7.inputs.json \\
          --load-outputs pg/target.prefill_P0_S7.outputs.json --atol 1e-4 --rtol 0
    """
    if num_prompts < 0 or max_new_tokens < 1:
        raise DFlashError("--num-prompts must be >= 0 and --max-new-tokens >= 1")
    for given, rev, flag in ((target_dir, revision, "--revision needs --target"), (draft_dir, draft_revision,
                                                                                  "--draft-revision needs --draft")):
        if rev is not None and given is None:
            raise DFlashError(flag)
    prompts = num_prompts
    if prompts_file is not None:  # read (and refused) before anything loads, tokenized as OUT's runtime would
        load_manifest(out, verify=False)
        prompts = read_prompts(prompts_file, load_tokenizer(out))
    target = None if target_dir is None else sources.resolve(target_dir, revision, "target")
    draft = None if draft_dir is None else sources.resolve(draft_dir, draft_revision, "drafter")
    report = export_check.run_check(out, target, draft, prompts=prompts, max_new_tokens=max_new_tokens, seed=seed,
                       save_polygraphy=save_polygraphy, provider=provider, progress=not as_json,
                       by_layer={"auto": None, "whole": False, "by-layer": True}[reference])
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        print_report(report)
    sys.exit(0 if report.passed else 1)


def print_report(report) -> None:
    console = Console(width=max(Console().width, 132))  # one row per output, unwrapped even when piped
    for warning in report.warnings:
        console.print(f"[yellow]warning[/]: {warning}", soft_wrap=True)
    q = report.quantization
    what = report.dtype if q is None else (f"{report.dtype} export, {q['scheme']} weights; vs = PyTorch with the "
                                           "graphs' dequantized weights (parity) or the float source (quantization error)")
    table = Table(title=f"parity vs PyTorch ({what})", title_justify="left")
    cols = ("graph", "case", *(("vs",) if q is not None else ()), "output", "max abs", "mean abs", "p99 abs", "tol", "top-1", "")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("graph", "case", "vs", "output") else "left")
    num = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
    for r in report.rows:
        table.add_row(r.graph, r.case, *((r.ref,) if q is not None else ()), r.output, num(r.max), num(r.mean), num(r.p99),
                      "-" if r.tol is None else f"{r.tol:g}", "-" if r.top1 is None else f"{r.top1:.4f}",
                      "[green]ok" if r.passed else "[red]FAIL")
    console.print(table)
    e = report.end_to_end
    if e:
        kv = report.kv_cache is not None  # an int8 cache: the oracle keeps a float one
        oracle = "the PyTorch oracle" + (" with the dequantized weights" if q is not None else "") + \
            (" (float cache)" if kv else "")
        console.print(f"end to end: {e['identical']}/{e['cases']} prompts token-identical to {oracle}, "
                      f"{e['acceptance_identical']}/{e['cases']} with identical acceptance lengths; "
                      f"tau {e['tau']:.2f}, acceptance histogram (1..K) {e['acceptance_histogram']}")
        if q is not None or kv:
            console.print(f"quantized: greedy agreement with the float source {e['agreement_length_mean']:.1f} tokens on average "
                          f"(min {e['agreement_length_min']}) of {e['max_new_tokens']}; speculative == plain greedy "
                          f"through the same graphs on {e['speculative_equals_plain']}/{e['cases']} prompts")
            for f in e["plain_failures"]:
                console.print(f"[red]speculative != plain[/] at token {f['first_difference']} for prompt {f['prompt']}")
        for f in e["failures"] if (q is None or report.strict) and not kv else []:
            console.print(f"[red]differs[/] at token {f['first_difference']} for prompt {f['prompt']}")
    a = report.accuracy
    if a:
        line = f"accuracy level {a['accuracy_level']} ({a['from']}): target logits vs the float source"
        if "float" in a:
            line += f" mean {a['float']['mean_abs']:.2e}, max {a['float']['max_abs']:.2e}, top-1 {a['float']['top1']:.4f}"
        if "dequantized" in a:
            line += (f"; of it, vs the graphs' own dequantized weights (the activations' rounding alone) mean "
                     f"{a['dequantized']['mean_abs']:.2e}, max {a['dequantized']['max_abs']:.2e}")
        console.print(line)
        if "draft_float" in a:
            d = a["draft_float"]
            console.print(f"drafter: draft_logits vs the float source mean {d['mean_abs']:.2e}, max {d['max_abs']:.2e}, "
                          f"top-1 {d['top1']:.4f} (costs acceptance at most; the output is the target's)")
        probe = (report.quantization or {}).get("accuracy_probe")
        if probe:
            console.print("measured at quantize time: " + "; ".join(
                f"level {lv}: step {p['step_ms']:.2f} ms, logits mean error vs float {p['logits_mean_abs_err']:.2e}, "
                f"top-1 {p['top1_agreement']:.3f}" for lv, p in probe.items() if lv.isdigit()))
    if report.draft_vocab:
        console.print(f"draft vocabulary: {report.draft_vocab} tokens (drafts outside it end a round early; the output is the target's)")
    for note in report.notes:
        console.print(f"note: {note}")
    failing = [r for r in report.rows if not r.passed]
    if failing:
        console.print(f"[red]FAILED[/]: {len(failing)} row(s):")
        for r in failing:
            what = "ids differ" if r.max is None else f"max abs {r.max:.3e} > tol {r.tol}"
            console.print(f"  {r.graph} {r.case} {r.output}{'' if q is None else ' vs ' + r.ref}: {what}")
    console.print("[green]PASSED" if report.passed else "[red]FAILED")


COMMANDS = [export, quantize, check]
