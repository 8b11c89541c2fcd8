"""`dflash-export demo`: the shipped pair end to end, offline, from an installed package.

export -> parity check (one line; the table with --verbose) -> streamed speculative
decoding of held-out prompts (ONNX Runtime, CPU) -> tau, tokens/s and speedup vs plain
decoding, measured as `bench` measures them (runtime/measure.py).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from .export import print_report
from .run import BUILTIN_PROMPTS
from .options import num_prompts_option, run_options
from ..demo.artifact import demo_dir
from ..runtime.controller import controller_for
from ..runtime.calibrate import calibrate, thread_candidates
from ..runtime.errors import DFlashError
from ..runtime.files import prompt_lines, readable
from ..runtime.lazy import lazy_import
from ..runtime.load import open_backend, settings_for
from ..runtime.loop import Generation, generate, stream
from ..runtime.measure import measure_many, off_domain_report, rate, summarize
from ..runtime.settings import RunOptions, VerifyPolicy, describe_policy, policy_json

export_artifact = lazy_import("dflash_export.export.artifact")  # torch, onnx: only when the demo runs
export_check = lazy_import("dflash_export.export.check")
STREAMED = 3  # prompts printed as they decode; the rest are measured quietly
OFF_DOMAIN = 8  # off-domain prompts measured (demo/prompts-offdomain.jsonl: random vocabulary text)


def demo_prompts(prompt: str | None, n: int, path: Path | None = None) -> list[str]:
    """--prompt, else the first n of --prompts FILE (lines, or *.jsonl "prompt" fields), else of the shipped ones."""
    if prompt is not None:
        return [prompt]
    if path is not None:
        return prompt_lines(path)[:n]
    path = demo_dir() / "prompts.jsonl"
    if not path.is_file():
        raise DFlashError(f"{path} is missing; pass --prompt TEXT or reinstall dflash-export")
    return prompt_lines(path, "")[:n]


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=None, help="where to export (default: a temporary folder)")
@click.option("--prompt", default=None, help="your own prompt (default: the shipped held-out prompts)")
@num_prompts_option(24, f"how many held-out prompts to measure (the first {STREAMED} are streamed)")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--pair", type=click.Path(path_type=Path), default=None,
              help="folder with target/ and draft/ (default: the shipped pair)")
@click.option("-v", "--verbose", is_flag=True, help="print the full parity table")
@run_options("threads", "spin", "verify", "speculation")  # ONNX Runtime on CPU
def demo(out, prompt, num_prompts, prompts_file, max_new_tokens, pair, verbose, run: RunOptions):
    """The shipped pair end to end, offline: export -> parity check -> calibration (threads,
    adaptive verify: runtime.json) -> streamed speculative decoding on held-out prompts (ONNX
    Runtime, CPU) -> tau, tokens/s and speedup vs plain decoding.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    console = Console()
    pair = Path(pair) if pair else demo_dir() / "pair"
    target_dir, draft_dir = pair / "target", pair / "draft"
    for d in (target_dir, draft_dir):
        if not (d / "config.json").is_file():
            raise DFlashError(f"the shipped pair is missing ({d}); reinstall dflash-export or pass --pair DIR")
    texts = demo_prompts(prompt, num_prompts, prompts_file)
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="dflash-demo-"))
    art = root / "artifact"
    root.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter

    console.rule("[bold]1. export (PyTorch -> ONNX, fp32, --attention ort)")
    t0 = clock()
    # the ORT-optimized target (in-place GroupQueryAttention, fused rotary and norms): the demo
    # runs on ONNX Runtime only, and it measured faster than the standard graph (docs/results.md)
    export_artifact.export_artifact(target_dir, draft_dir, art, dtype="fp32", max_context=1024, force=True, attention="ort")
    t_export = clock() - t0

    console.rule("[bold]2. parity check (ONNX Runtime vs PyTorch)")
    t0 = clock()
    report = export_check.run_check(art, target_dir, draft_dir, prompts=4, max_new_tokens=32)
    if verbose:
        print_report(report)
    console.print(report.summary(), style="green" if report.passed else "red", markup=False, highlight=False)
    t_check = clock() - t0
    if not report.passed:
        raise DFlashError(f"the parity check failed for {art}; rerun with --verbose for the table")

    console.rule("[bold]3. calibration (threads, adaptive verify -> runtime.json)")
    tok = Tokenizer.from_file(str(readable(art / "tokenizer.json")))
    candidates = thread_candidates() if run.threads is None else [run.threads]
    t0 = clock()
    if run.verify == "auto":  # calibrated on the built-in prompts, measured below on the held-out ones
        calibrate(art, run, candidates, [tok.encode(p).ids for p in BUILTIN_PROMPTS],
                  max_new_tokens, 1, log=lambda msg: console.print(f"calibrate: {msg}", markup=False))
    t_cal = clock() - t0
    cfg = settings_for(art, run)

    console.rule(f"[bold]4. speculative decoding (ONNX Runtime, CPU, greedy, {cfg.threads} thread(s))")
    t0 = clock()
    result = decode(console, art, texts, max_new_tokens, cfg, candidates, run.speculation)
    t_gen = clock() - t0
    print_result(console, result, len(texts), max_new_tokens)
    console.print(f"export {t_export:.0f}s, parity check {t_check:.0f}s, calibration {t_cal:.0f}s, "
                  f"generation {t_gen:.0f}s; artifact in {art}")
    if not result["lossless"]:
        raise DFlashError("speculative output differs from plain greedy decoding: the lossless property is broken")


def decode(console, art: Path, texts: list[str], max_new_tokens: int, cfg, candidates: list[int],
           speculation: str = "auto") -> dict:
    """Stream the first prompts (prompt first, then the continuation), measure all of them
    speculative (with `cfg`'s threads and verify policy) and plain (at every candidate thread
    count: the best is the fair baseline), and return the bench report (runtime/measure.py)."""
    tok = Tokenizer.from_file(str(readable(art / "tokenizer.json")))
    backends = {t: open_backend(art, "ort", "cpu", threads=t, spin=cfg.spin, spin_us=cfg.spin_us)
                for t in sorted(set(candidates) | {cfg.threads})}
    backend = backends[cfg.threads]
    if set(cfg.graph_threads.values()) - {cfg.threads}:  # the calibrated per-graph counts
        backend = open_backend(art, "ort", "cpu", **cfg.ort_kwargs())
    warm = tok.encode(texts[0]).ids
    control, draft = controller_for(speculation, cfg.costs, backend.manifest.block_size), speculation != "never"
    for be in {*backends.values(), backend}:  # untimed warm-up of both paths
        generate(be, warm, 16, draft=draft, verify=cfg.verify, control=control)
        generate(be, warm, 16, draft=False)
    spec, base_by = [], {t: [] for t in backends}
    for i, text in enumerate(texts):
        ids = tok.encode(text).ids
        room = backend.manifest.max_context - len(ids)
        if room < 2:
            raise DFlashError(f"prompt {i + 1} has {len(ids)} tokens; the demo export holds {backend.manifest.max_context}")
        n, g = min(max_new_tokens, room), Generation()
        if i < STREAMED:
            console.print(f"[dim]--- prompt {i + 1}/{len(texts)} ({len(ids)} tokens) ---[/]")
            console.print(text.rstrip("\n")[-400:], style="dim", markup=False, highlight=False)
            console.print("[dim]--- continuation (speculative, streamed) ---[/]")
            for emitted in stream(backend, ids, n, verify=cfg.verify, out=g, control=control, draft=draft):
                console.print(tok.decode(emitted), end="", style="bold green", markup=False, highlight=False, soft_wrap=True)
            console.print()
        else:
            if i == STREAMED:
                console.print(f"[dim]--- prompts {STREAMED + 1}-{len(texts)}: measured without printing ---[/]")
            for _ in stream(backend, ids, n, verify=cfg.verify, out=g, control=control, draft=draft):
                pass
        spec.append(g)
        for t, be in backends.items():
            base_by[t].append(generate(be, ids, n, draft=False))
    r = summarize(spec, base_by[cfg.threads], backend.manifest.block_size)
    best = max(base_by, key=lambda t: rate(base_by[t]))
    r.update(threads=cfg.threads, graph_threads=cfg.graph_threads or None, verify=policy_json(cfg.verify), best_plain_threads=best,
             speedup_vs_best_plain=rate(spec) / rate(base_by[best]),
             lossless=r["lossless"] and all(s.tokens == b.tokens for bs in base_by.values() for s, b in zip(spec, bs)),
             speculation=speculation)
    off_path = demo_dir() / "prompts-offdomain.jsonl"
    if off_path.is_file():  # the same comparison off the drafter's domain (synthetic random-vocabulary text)
        off = [tok.encode(t).ids[: backend.manifest.max_context - max_new_tokens]
               for t in demo_prompts(None, OFF_DOMAIN, off_path)]
        r["off_domain"] = off_domain_report(backend, off, max_new_tokens, cfg.verify, 0.0, control, draft)
        r["lossless"] = r["lossless"] and r["off_domain"]["lossless"]
    return r


def print_result(console, r: dict, prompts: int, max_new_tokens: int) -> None:
    """The result table (short labels: it fits 80 columns) and what its rows mean, below it."""
    table = Table(title=f"demo: {prompts} held-out prompt(s) x {max_new_tokens} new tokens, ONNX Runtime CPU, greedy",
                  title_justify="left")
    table.add_column("")
    table.add_column("DFlash", justify="right")
    table.add_column("plain", justify="right")
    t, split = r["tokens_per_second"], r["time_split_s"]
    table.add_row("tau (tokens per drafted round)", f"{r['tau']:.2f}", "1.00")
    table.add_row("positions verified per round", f"{r['mean_verify_len']:.1f}", "1.0")
    table.add_row("rounds drafted / plain steps", f"{r['rounds']['drafted']} / {r['rounds']['plain']}", "")
    table.add_row("tokens/s (decode) [1]", f"{t['speculative']:.0f}", f"{t['autoregressive']:.0f}")
    table.add_row("speedup, same threads [1]", f"[bold]{r['speedup']:.2f}x", "1.00x")
    table.add_row("speedup, each at its best [2]", f"[bold]{r['speedup_vs_best_plain']:.2f}x", "1.00x")
    table.add_row("loop efficiency [3]", f"{r['loop_efficiency']:.3f}", "")
    pd = {side: f"{x['prefill']:.2f} / {x['total'] - x['prefill']:.2f}" for side, x in split.items()}
    table.add_row("time: prefill / decode (s)", pd["speculative"], pd["autoregressive"])
    table.add_row("time: draft/verify/host (s)", "/".join(f"{split['speculative'][k]:.2f}" for k in ("draft", "verify", "host")),
                  f"-/{split['autoregressive']['verify']:.2f}/{split['autoregressive']['host']:.2f}")
    if "off_domain" in r:
        o = r["off_domain"]
        table.add_row("off-domain [4]: tokens/s", f"{o['tokens_per_second']['speculative']:.0f}",
                      f"{o['tokens_per_second']['autoregressive']:.0f}")
        table.add_row("off-domain [4]: speedup", f"[bold]{o['speedup']:.2f}x", "1.00x")
    table.add_row("output identical to plain greedy", "yes" if r["lossless"] else "[red]NO", "")
    console.print(table)
    verify = describe_policy(None if r["verify"] == "full" else VerifyPolicy(**r["verify"]))
    notes = [f"[1] both sides at {r['threads']} thread(s); block {r['block_size']}, verify: {verify}, "
             f"speculation {r['speculation']}",
             f"[2] DFlash at {r['threads']} thread(s) (calibrated), plain at its fastest count "
             f"({r['best_plain_threads']})",
             "[3] speedup / the speedup this run's graph calls allow (drafted rounds' calls, plain steps)"]
    if "off_domain" in r:
        o = r["off_domain"]
        notes.append(f"[4] {o['prompts']} random-vocabulary prompts (the drafter's worst case), same threads: "
                     f"tau {o['tau']:.2f}, rounds drafted / plain {o['rounds']['drafted']} / {o['rounds']['plain']}")
    for line in notes:
        console.print(line, markup=False, highlight=False)


COMMANDS = [demo]
