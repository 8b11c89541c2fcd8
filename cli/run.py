"""`generate` and `bench`: run an exported directory with ONNX Runtime (torch-free).

Only numpy, onnxruntime and tokenizers are imported here (matplotlib lazily for --plot),
so both commands work on a machine without torch.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from importlib.util import find_spec
from pathlib import Path

import click
import numpy as np

from .batch import check_batch_value, echo_bench_batch, generate_many
from .options import resolve_speculation, run_options, sampling_options
from ..runtime.controller import auto_policy, controller_for, describe_auto, rounds_of
from ..runtime.calibrate import calibrate, choose_count, describe_spin, prefill_ms, step_ms_by_context, thread_candidates, ttft_prompt
from ..runtime.errors import DFlashError
from ..runtime.files import prompt_lines
from ..runtime.load import open_artifact, open_backend, settings_for
from ..runtime.loop import Generation
from ..runtime.loop import stream as stream_rounds
from ..runtime.manifest import load_manifest
from ..runtime.sampling import Sampling
from ..runtime.measure import bench_batch, measure_many, off_domain_report, random_text_prompts, rate, summarize
from ..runtime.settings import RunOptions, policy_json
from ..serve.text import load_tokenizer

BUILTIN_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three laws of thermodynamics are",
    "Question: A train travels 60 km in 45 minutes. What is its average speed in km/h?\nAnswer:",
    "import numpy as np\n\ndef softmax(x):\n",
    "Once upon a time, in a small village by the sea,",
]


def _parse_ids(text: str, what: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise DFlashError(f"{what} must be comma-separated integers (got {text!r})") from None


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--prompt", help="Prompt text (needs tokenizer.json in OUT).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids (no tokenizer needed).")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path),
              help="Many prompts, one per line (as bench --prompts): one output line each, run --batch at a time.")
@click.option("--batch", default=1, show_default=True, type=int,
              help="With --prompts: rows decoded together (one graph call per round for all of them).")
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@sampling_options
@click.option("--stop-ids", help="Comma-separated stop token ids (default: the manifest's eos_token_ids; '' for none).")
@click.option("--no-draft", is_flag=True, help="Plain autoregressive decoding of the target (= --speculation never).")
@click.option("--stream", is_flag=True, help="Print tokens as each round is accepted.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with tokens and statistics.")
@run_options()
def generate(out, prompt, prompt_ids, prompts_file, batch, max_new_tokens, sampling, stop_ids,
             no_draft, stream, as_json, run: RunOptions):
    """Speculative decoding of a prompt (or of --prompts FILE, --batch at a time) with an exported directory OUT."""
    if sum(x is not None for x in (prompt, prompt_ids, prompts_file)) != 1:
        raise DFlashError("give exactly one of --prompt TEXT, --prompt-ids 1,2,3 or --prompts FILE")
    if check_batch_value(batch) > 1 and prompts_file is None:
        raise DFlashError("--batch needs --prompts FILE (one prompt per line)")
    if stream and (as_json or prompts_file is not None):
        raise DFlashError("--stream and --json (or --prompts) are exclusive: --stream prints one prompt as it comes")
    stop = None if stop_ids is None else tuple(_parse_ids(stop_ids, "--stop-ids"))
    speculation = resolve_speculation(no_draft, run.speculation)
    run = dataclasses.replace(run, speculation=speculation)
    no_draft = speculation == "never"
    if prompts_file is not None:
        be, cfg = open_artifact(out, run, drafter=not no_draft, max_batch=batch)
        tok = load_tokenizer(out)
        prompts, _ = _bench_prompts(prompts_file, tok, be.manifest.vocab_size)
        generate_many(be, tok, prompts, max_new_tokens, batch, not no_draft, cfg.verify, as_json,
                      control=controller_for(speculation, cfg.costs, be.manifest.block_size),
                      sampling=sampling, stop_token_ids=stop)
        return
    ids = _parse_ids(prompt_ids, "--prompt-ids") if prompt_ids is not None else None
    backend, cfg = open_artifact(out, run, drafter=not no_draft)
    tok = load_tokenizer(out)
    if ids is None:
        if tok is None:
            raise DFlashError(f"{out} has no tokenizer.json, so --prompt cannot be tokenized; use --prompt-ids 1,2,3")
        ids = tok.encode(prompt).ids

    g = Generation()
    shown = ""
    for new in stream_rounds(backend, ids, max_new_tokens, sampling=sampling, stop_token_ids=stop, draft=not no_draft, verify=cfg.verify, out=g,
                   control=controller_for(speculation, cfg.costs, backend.manifest.block_size)):
        if stream:
            if tok is not None:
                text = tok.decode(g.tokens)
                click.echo(text[len(shown):], nl=False)
                shown = text
            else:
                click.echo(" ".join(map(str, new)) + " ", nl=False)
            sys.stdout.flush()
    result = {
        "tokens": g.tokens,
        "acceptance_lengths": g.acceptance_lengths,
        "tau": g.tau,
        "mean_verify_len": g.mean_verify_len,
        "verify": policy_json(cfg.verify),
        "threads": cfg.threads,
        "graph_threads": cfg.graph_threads or None,
        "tokens_per_second": g.tokens_per_second,
        "prompt_tokens": len(ids),
        "stopped": g.stopped,
        "mode": "autoregressive" if no_draft else "speculative",
        "speculation": speculation,
        "rounds": rounds_of([g]),  # {"drafted": n, "plain": m}
        "provider": backend.provider,
        "time_s": {"prefill": g.prefill_s, "draft": g.draft_s, "verify": g.verify_s, "host": g.host_s, "total": g.total_s},
        "round_ms": [[round(x * 1e3, 3) for x in r] for r in g.round_s],  # [draft, verify, host] per round
    }
    if tok is not None:
        result["text"] = tok.decode(g.tokens)
    if as_json:
        click.echo(json.dumps(result))
        return
    if stream:
        click.echo()
    else:
        click.echo(result.get("text", " ".join(map(str, g.tokens))))
    click.echo(
        f"{len(g.tokens)} tokens, tau {g.tau:.2f} (verified {g.mean_verify_len:.1f}/round; rounds "
        f"{result['rounds']['drafted']} drafted, {result['rounds']['plain']} plain), "
        f"{g.tokens_per_second:.1f} tok/s (decode), "
        f"prefill {g.prefill_s * 1e3:.1f} ms, draft {g.draft_s * 1e3:.1f} ms, verify {g.verify_s * 1e3:.1f} ms, "
        f"host {g.host_s * 1e3:.1f} ms [{backend.provider}]",
        err=True,
    )


# -- bench ---------------------------------------------------------------------------------


def read_prompts(path: Path, tok) -> list[list[int]]:
    """--prompts FILE as token ids: each line text (through the exported tokenizer) or comma-separated ids."""
    prompts = []
    for ln in prompt_lines(path):
        if all(p.strip().isdigit() for p in ln.split(",")):
            prompts.append(_parse_ids(ln, f"--prompts {path}"))
        elif tok is None:
            raise DFlashError(f"--prompts {path}: text prompts need tokenizer.json in the exported directory; "
                              "write comma-separated token ids instead")
        else:
            prompts.append(tok.encode(ln).ids)
    return prompts


def _bench_prompts(path: Path | None, tok, vocab: int, n_random: int = 5, length: int = 32) -> tuple[list[list[int]], str]:
    if path is not None:
        prompts = read_prompts(path, tok)
        return prompts, f"{len(prompts)} prompts from {path}"
    if tok is not None:
        return [tok.encode(p).ids for p in BUILTIN_PROMPTS], f"{len(BUILTIN_PROMPTS)} built-in text prompts"
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, length).tolist() for _ in range(n_random)]
    return prompts, f"{n_random} random token prompts of {length} tokens (no tokenizer in the directory)"


def plot_bench(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError("--plot needs matplotlib: pip install 'dflash-export[dev]' (or matplotlib)") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    hist = report["acceptance_histogram"]
    ax1.bar([int(k) for k in hist], list(hist.values()), color="tab:blue")
    ax1.set(title=f"acceptance length per round (tau {report['tau']:.2f})", xlabel="tokens per round", ylabel="rounds")
    bottom = np.zeros(2)
    modes = ["speculative", "autoregressive"]
    for phase in ("prefill", "draft", "verify", "host"):
        vals = np.array([report["time_split_s"][m][phase] for m in modes])
        ax2.bar(modes, vals, bottom=bottom, label=phase)
        bottom += vals
    ax2.set(title=f"time split (speedup {report['speedup']:.2f}x)", ylabel="seconds")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path),
              help="One prompt per line: text (needs the tokenizer) or comma-separated token ids; "
                   "*.jsonl: a \"prompt\" field per line.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--warmup", default=1, show_default=True, type=int, help="Untimed runs before measuring.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--plot", type=click.Path(path_type=Path), help="Write the acceptance histogram and time split (PNG).")
@click.option("--calibrate", "do_calibrate", is_flag=True,
              help="First measure the best thread count and the adaptive verify policy on these prompts and "
                   "write them to OUT/runtime.json (graph hashes untouched), then bench with them.")
@click.option("--context", "contexts", help="Comma-separated context lengths (e.g. 128,2048): also report the "
                                             "1-token step time after each (step_ms_by_context).")
@click.option("--batch", default=1, show_default=True, type=int,
              help="Decode the prompts N rows at a time and report aggregate and per-request tokens/s, tau and "
                   "occupancy against batch 1 in the same run (interleaved).")
@click.option("--temperature", default=0.0, show_default=True, type=float,
              help="> 0: sampled rounds (rejection sampling, seed = prompt index): tau at this temperature.")
@click.option("--off-domain", "off_domain", default=4, show_default=True, type=int,
              help="Also measure on N off-domain prompts (128 random vocabulary tokens each, seed 0, decoded: "
                   "what synthetic load generators send); 0 skips.")
@run_options()
def bench(out, prompts_file, max_new_tokens, warmup, as_json, plot, do_calibrate, contexts, batch, temperature, off_domain,
          run: RunOptions):
    """Speculative vs plain decoding of OUT on the same prompts: tau, tokens/s, speedup.

    Without --threads every candidate thread count runs too (interleaved), which gives
    best_threads and speedup_vs_best_plain (plain decoding at its own best count).
    """
    if plot is not None:
        if find_spec("matplotlib") is None:  # fail before minutes of benchmarking
            raise DFlashError("--plot needs matplotlib: pip install 'dflash-export[dev]' (or matplotlib)")
    ctx = sorted({int(c) for c in _parse_ids(contexts, "--context")}) if contexts else []
    if contexts is not None and (not ctx or min(ctx) < 1):
        raise DFlashError(f"--context must be positive lengths like 128,2048 (got {contexts!r})")
    m = load_manifest(out, verify=True)
    if ctx and max(ctx) + m.block_size > m.max_context:
        raise DFlashError(f"--context {max(ctx)} needs an export with --max-context >= {max(ctx) + m.block_size} "
                          f"(context + block size); {out} holds {m.max_context}")
    Sampling(temperature)  # checked before anything loads
    if off_domain < 0:
        raise DFlashError(f"--off-domain must be >= 0 (got {off_domain})")
    tok = load_tokenizer(out)
    prompts, source = _bench_prompts(prompts_file, tok, m.vocab_size)
    room = m.max_context - max(len(p) for p in prompts)
    if room < 1:
        raise DFlashError(f"a prompt fills the max context {m.max_context}; use shorter prompts")
    n = min(max_new_tokens, room)
    if batch != 1:
        check_batch_value(batch)
        if do_calibrate or plot is not None or ctx or temperature:
            raise DFlashError("--batch runs its own comparison; leave out --calibrate, --plot, --context, --temperature")
        cfg = settings_for(out, run)
        report = bench_batch(lambda b: open_artifact(out, run, max_batch=b, settings=cfg)[0], prompts, n, batch, warmup,
                             cfg.verify, control=controller_for(run.speculation, cfg.costs, m.block_size),
                             draft=run.speculation != "never")
        report.update(prompt_source=source, threads=cfg.threads, speculation=run.speculation)
        click.echo(json.dumps(report)) if as_json else echo_bench_batch(report)
        return
    sweep = run.backend == "ort" and run.threads is None
    cfg = settings_for(out, run)
    candidates = thread_candidates() if sweep else [cfg.threads]
    calibration = None
    if do_calibrate:
        log = (lambda msg: click.echo(f"calibrate: {msg}", err=True)) if not as_json else (lambda msg: None)
        calibration = calibrate(out, run, candidates, prompts, n, warmup, log)
        cfg = settings_for(out, run)  # with what the calibration wrote
    backends, key = _backends_by_threads(out, run, cfg, candidates, sweep)
    speculation = run.speculation
    control, draft = controller_for(speculation, cfg.costs, m.block_size), speculation != "never"
    runs = measure_many(backends, prompts, n, warmup, cfg.verify, temperature, control, draft)
    main = backends[key]
    report = {"provider": main.provider, "speculation": speculation, "costs": control.costs.source if control else None,
              "auto_policy": auto_policy(control.costs, m.block_size) if control else None,
              **summarize(*runs[key], m.block_size, temperature)}
    report.update(max_new_tokens=n, prompt_source=source, threads=cfg.threads, graph_threads=cfg.graph_threads or None,
                  spin=cfg.spin, spin_us=cfg.spin_us if cfg.spin else None, verify=policy_json(cfg.verify), draft_vocab=(m.draft_vocab or {}).get("size"),
                  prefill_chunk=min(main.max_chunk, cfg.prefill_chunk or main.max_chunk))
    if sweep:
        by = {t: {"speculative": rate(sp), "autoregressive": rate(ba)} for t, (sp, ba) in runs.items() if t != "graphs"}
        report["by_threads"] = {str(t): v for t, v in by.items()}
        report["best_threads"] = choose_count({t: v["speculative"] for t, v in by.items()})  # calibrate's rule
        report["speedup_vs_best_plain"] = rate(runs[key][0]) / max(v["autoregressive"] for v in by.values())
    if calibration is not None:
        report["calibration"] = calibration
    if off_domain and tok is not None:  # the same comparison on synthetic off-domain text
        off = [tok.encode(t).ids[: m.max_context - n] for t in random_text_prompts(tok, m.vocab_size, off_domain)]
        o = off_domain_report(main, off, n, cfg.verify, temperature, control, draft)
        report["off_domain"] = {"prompts": o["prompts"], "source": "128 random vocabulary tokens each, seed 0", **o}
    if ctx:
        report["step_ms_by_context"] = step_ms_by_context(main, ctx)
    long = ttft_prompt(main)  # time to first token: prefill of target and drafter at the run's chunk
    report.update(ttft_prompt_tokens=len(long), ttft_ms=prefill_ms(main, long, [report["prefill_chunk"]])[report["prefill_chunk"]])
    for b in backends.values():
        b.close()
    if plot is not None:
        plot_bench(report, plot)
    if as_json:
        click.echo(json.dumps(report))
        return
    echo_bench(report, source, m.vocab_size, temperature)
    if plot is not None:
        click.echo(f"plot: {plot}")


def _backends_by_threads(out, run: RunOptions, cfg, candidates: list[int], sweep: bool) -> tuple[dict, object]:
    """({thread count: backend} to measure side by side, the key of the run's own): a sweep opens
    every candidate count; the run's backend uses the calibrated per-graph counts when they differ."""
    backend, provider = run.backend, run.provider
    labels = sorted(set(candidates) | {cfg.threads}) if sweep else [cfg.threads]

    def open_(t):
        if backend == "trt":
            return open_backend(out, "trt")
        return open_backend(out, "ort", provider, **(cfg.ort_kwargs() | {"threads": t, "graph_threads": {}}))

    backends = {t: open_(t) for t in labels}
    key = cfg.threads  # the run's backend: the calibrated per-graph counts, else one count for all
    if cfg.graph_threads and backend == "ort" and set(cfg.graph_threads.values()) != {cfg.threads}:
        key = "graphs"
        backends[key] = open_backend(out, "ort", provider, **cfg.ort_kwargs())
        if not sweep:
            del backends[cfg.threads]
    return backends, key


def echo_bench(r: dict, source: str, vocab_size: int, temperature: float) -> None:
    """bench's report for people: the settings, tau and speedup, then where the time went."""
    t = r["tokens_per_second"]
    per_graph = f" (per graph {r['graph_threads']})" if set((r["graph_threads"] or {}).values()) - {r["threads"]} else ""
    click.echo(f"prompts: {source}; {r['max_new_tokens']} new tokens each; {r['provider']}; threads {r['threads']}"
               f"{per_graph}, spin {describe_spin(r['spin'], r.get('spin_us'))}, verify {r['verify']}")
    if r.get("draft_vocab"):
        click.echo(f"draft vocabulary: {r['draft_vocab']} of {vocab_size} tokens")
    click.echo(f"tau {r['tau']:.2f}{f' at temperature {temperature}' if temperature else ''}, mean verify length {r['mean_verify_len']:.2f}  histogram {r['acceptance_histogram']}")
    click.echo(f"speculative {t['speculative']:.1f} tok/s, autoregressive {t['autoregressive']:.1f} tok/s, "
               f"speedup {r['speedup']:.2f}x")
    click.echo(f"speculation {r['speculation']}: {r['rounds']['drafted']} rounds drafted, {r['rounds']['plain']} plain"
               + (f" (cost model: {r['costs']})" if r["costs"] else ""))
    if r["auto_policy"]:
        click.echo(describe_auto(r["auto_policy"], r["costs"]))
    if "off_domain" in r:
        o = r["off_domain"]
        click.echo(f"off-domain ({o['prompts']} prompts, {o['source']}): speculative "
                   f"{o['tokens_per_second']['speculative']:.1f} tok/s, autoregressive "
                   f"{o['tokens_per_second']['autoregressive']:.1f} tok/s, speedup {o['speedup']:.2f}x, tau {o['tau']:.2f}, "
                   f"rounds {o['rounds']['drafted']} drafted / {o['rounds']['plain']} plain")
    if "by_threads" in r:
        other = "" if r["best_threads"] == r["threads"] else \
            f" (the run above used {r['threads']}: a difference within noise, or rerun bench --calibrate)"
        click.echo(f"thread sweep: fastest at {r['best_threads']}{other}; speedup vs plain at its best thread count "
                   f"{r['speedup_vs_best_plain']:.2f}x; by threads {r['by_threads']}")
    click.echo(f"time to first token: {r['ttft_ms']:.1f} ms for a {r['ttft_prompt_tokens']}-token prompt "
               f"(prefill chunk {r['prefill_chunk']})")
    c = r["ms_per_call"]
    click.echo(f"calls: step {c['step']:.2f} ms, draft {c['draft']:.2f} ms, verify {c['verify']:.2f} ms -> "
               f"ideal speedup {r['ideal_speedup']:.2f}x, loop efficiency {r['loop_efficiency']:.3f}")
    for mode, s in r["time_split_s"].items():
        click.echo(f"{mode}: " + ", ".join(f"{k} {v:.3f}s" for k, v in s.items()))
    if "step_ms_by_context" in r:
        click.echo("step ms by context: " + ", ".join(f"{k}: {v:.3f}" for k, v in r["step_ms_by_context"].items()))
    lossless = "not compared (sampled)" if r["lossless"] is None else r["lossless"]
    click.echo(f"lossless (speculative == autoregressive tokens): {lossless}; peak RSS {r['peak_rss_mb']:.0f} MB")


COMMANDS = [generate, bench]
