"""`dflash-export train-draft`: train a DFlash drafter for a target, on the target's own text.

Heavy imports (torch, models) stay inside the functions so the CLI starts fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import click

from .runtime.errors import DFlashError


def parse_layer_ids(text: str | None) -> list[int] | None:
    """'1,3,4' or '1-4' or '1-3,5' -> [1, 3, 4] / [1, 2, 3, 4] / [1, 2, 3, 5]."""
    if not text:
        return None
    ids: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                ids += range(int(lo), int(hi) + 1)
            else:
                ids.append(int(part))
    except ValueError:
        raise DFlashError(f"--target-layer-ids {text!r} is not a list like 1,3,4 or 1-4") from None
    return ids


def default_taps(num_layers: int) -> list[int]:
    """Up to 5 layers spread over [1, L-2] (an early, some middle, a late one)."""
    if num_layers < 3:
        return list(range(num_layers))
    hi = num_layers - 2
    n = min(5, hi)
    return sorted({round(1 + i * (hi - 1) / max(n - 1, 1)) for i in range(n)})


def load_tokenizer(target_dir: Path):
    from tokenizers import Tokenizer

    path = target_dir / "tokenizer.json"
    if not path.is_file():
        raise DFlashError(f"target {target_dir} has no tokenizer.json; train-draft needs it to tokenize --data")
    return Tokenizer.from_file(str(path))


def resolve_mask_id(target_dir: Path, tok, override: int | None, vocab: int) -> int:
    """--mask-token-id, else the tokenizer's mask token (tokenizer_config.json `mask_token`, or `<|mask|>`)."""
    if override is None:
        name = None
        cfg = target_dir / "tokenizer_config.json"
        if cfg.is_file():
            m = json.loads(cfg.read_text()).get("mask_token")
            name = m.get("content") if isinstance(m, dict) else m
        override = tok.token_to_id(name or "<|mask|>")
        if override is None:
            raise DFlashError(f"target {target_dir}: the tokenizer has no mask token; pass --mask-token-id ID "
                              "(a token id the target never produces, e.g. a reserved special token)")
    if not 0 <= override < vocab:
        raise DFlashError(f"mask token id {override} is outside the target's vocabulary [0, {vocab})")
    return int(override)


def _hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _save_drafter(drafter, out: Path, dtype: str) -> None:
    """Write the z-lab directory next to OUT, then swap it in: OUT is never half-written."""
    import copy

    import torch

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = copy.deepcopy(drafter)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
        model.config.raw["dtype"] = model.config.raw["torch_dtype"] = "bfloat16"
    model.save_pretrained(tmp)
    for extra in ("training.json",):
        if (out / extra).is_file():
            shutil.copy(out / extra, tmp / extra)
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


@click.command("train-draft")
@click.option("--target", "target_dir", required=True, type=click.Path(path_type=Path), help="HF target checkpoint (with tokenizer.json)")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="drafter directory to write (z-lab format)")
@click.option("--data", multiple=True, required=True, type=click.Path(path_type=Path), help="text files or JSONL prompts (repeatable)")
@click.option("--eval-prompts", type=click.Path(path_type=Path), default=None, help="held-out prompts (default: 5%% of --data)")
@click.option("--block-size", default=16, show_default=True)
@click.option("--layers", default=1, show_default=True, type=click.IntRange(1, 8), help="drafter depth (1-8)")
@click.option("--target-layer-ids", default=None, help="taps, e.g. 1,3,4 (default: up to 5 spread over [1, L-2])")
@click.option("--intermediate-size", default=None, type=int, help="drafter MLP width (default: the target's)")
@click.option("--gamma", default=7.0, show_default=True, help="loss weight decay: w_k = exp(-(k-1)/gamma)")
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--batch", default=8, show_default=True, help="sequences per step")
@click.option("--anchors", default=48, show_default=True, help="random anchors (blocks) per sequence")
@click.option("--steps", default=0, help="train for N steps ...")
@click.option("--minutes", default=0.0, help="... or for M minutes of training (generation not counted)")
@click.option("--sequences", default=2048, show_default=True, help="continuations to generate (cached)")
@click.option("--gen-minutes", default=0.0, help="stop generating new continuations after M minutes (0: all --sequences)")
@click.option("--gen-tokens", default=256, show_default=True, help="new tokens per continuation")
@click.option("--gen-batch", default=64, show_default=True, help="prompts per batched generation pass")
@click.option("--sample-prefix", default=0, show_default=True, help="half the batches: sample this many tokens before the greedy part (diversity)")
@click.option("--prompt-max-tokens", default=160, show_default=True)
@click.option("--mask-token-id", default=None, type=int, help="default: the tokenizer's mask token")
@click.option("--eval-every", default=0, help="real tau + teacher-forced eval every N steps (0: only at the end)")
@click.option("--eval-n", default=8, show_default=True, help="held-out prompts for the periodic eval")
@click.option("--eval-tokens", default=128, show_default=True, help="new tokens per held-out prompt")
@click.option("--save-dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--work", type=click.Path(path_type=Path), default=None, help="cache + checkpoint folder (default OUT.work)")
@click.option("--resume", is_flag=True, help="continue from the last checkpoint in --work")
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=0, help="torch threads (default: all cores)")
def train_draft(target_dir, out, data, eval_prompts, block_size, layers, target_layer_ids, intermediate_size, gamma,
                lr, batch, anchors, steps, minutes, sequences, gen_minutes, gen_tokens, gen_batch, sample_prefix,
                prompt_max_tokens, mask_token_id, eval_every, eval_n, eval_tokens, save_dtype, work, resume, seed,
                threads):
    """Train a DFlash drafter on the target's own continuations of --data; writes a z-lab drafter.

    The target is frozen; the drafter borrows its embedding and LM head. At the end the
    drafter is reloaded from OUT and measured by real speculative decoding on held-out prompts.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if (steps > 0) == (minutes > 0):
        raise DFlashError("give exactly one of --steps N or --minutes M")
    if block_size < 2:
        raise DFlashError(f"--block-size must be >= 2 (got {block_size})")
    run_training(**locals())


def run_training(target_dir, out, data, eval_prompts, block_size, layers, target_layer_ids, intermediate_size, gamma,
                 lr, batch, anchors, steps, minutes, sequences, gen_minutes, gen_tokens, gen_batch, sample_prefix,
                 prompt_max_tokens, mask_token_id, eval_every, eval_n, eval_tokens, save_dtype, work, resume, seed,
                 threads, log=print) -> dict:
    import random

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .models import Drafter, Target, TargetConfig, draft_config_dict
    from .models import train as T
    from .models.config import DraftConfig

    console = Console(stderr=True)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    torch.manual_seed(seed)
    target_dir, out = Path(target_dir), Path(out)
    work = Path(work) if work else out.with_name(out.name + ".work")

    # -- the target, and a drafter that fits it ---------------------------------------
    tc = TargetConfig.load(target_dir)
    taps = parse_layer_ids(target_layer_ids) or default_taps(tc.num_layers)
    bad = [i for i in taps if not 0 <= i < tc.num_layers]
    if bad:
        raise DFlashError(f"--target-layer-ids {bad} are outside the target's {tc.num_layers} layers (0..{tc.num_layers - 1})")
    tok = load_tokenizer(target_dir)
    mask_id = resolve_mask_id(target_dir, tok, mask_token_id, tc.vocab_size)
    target = Target.from_pretrained(target_dir, tap_ids=taps).requires_grad_(False)
    cfg = draft_config_dict(tc, num_layers=layers, block_size=block_size, target_layer_ids=taps,
                            mask_token_id=mask_id, intermediate_size=intermediate_size)
    DraftConfig.from_dict(cfg).check_fits(tc)
    from .models import new_drafter

    drafter = new_drafter(tc, num_layers=layers, block_size=block_size, target_layer_ids=taps,
                          mask_token_id=mask_id, intermediate_size=intermediate_size).train()
    stop = tuple(tc.eos_token_ids)

    # -- data: the target's own continuations, cached ---------------------------------
    texts = T.read_prompts(list(data), seed=seed)
    random.Random(seed).shuffle(texts)
    if eval_prompts:
        eval_texts = T.read_prompts([eval_prompts], seed=seed)
    else:
        n_eval = max(4, len(texts) // 20)
        if len(texts) <= n_eval:
            raise DFlashError(f"only {len(texts)} prompts in --data; give more data or --eval-prompts")
        texts, eval_texts = texts[n_eval:], texts[:n_eval]
    ids = [e.ids for e in tok.encode_batch(texts[:sequences])]
    eval_ids = [e.ids[-prompt_max_tokens:] for e in tok.encode_batch(eval_texts)]
    eval_ids = [p for p in eval_ids if p]
    if not eval_ids:
        raise DFlashError("no non-empty held-out prompts")
    train_batches = T.bucket_batches(ids, gen_batch, 8, prompt_max_tokens, seed)
    eval_batches = T.bucket_batches(eval_ids, gen_batch, 1, prompt_max_tokens, seed)
    fp = T.target_fingerprint(target_dir)
    gen_dir = work / f"gen-{_hash(fp, texts[:sequences], gen_tokens, gen_batch, sample_prefix, prompt_max_tokens, seed)}"
    eval_dir = work / f"eval-{_hash(fp, eval_texts, gen_tokens, gen_batch, prompt_max_tokens)}"
    n_seq = sum(len(b) for b in train_batches)
    log(f"target {target_dir}: {tc.num_layers} layers, hidden {tc.hidden_size}, taps {taps}, mask id {mask_id}")
    log(f"data: {n_seq} training prompts, {len(eval_ids)} held-out prompts; continuations cached in {work}")

    def gen_progress(name, total_batches):
        p = Progress(TextColumn(f"[bold]{name}"), BarColumn(), TextColumn("{task.completed}/{task.total} batches"),
                     TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)
        task = p.add_task(name, total=total_batches, tps="-")
        t0, made = time.time(), [0]

        def update(i, n, new):
            made[0] += new
            p.update(task, completed=i, tps=f"{made[0] / max(time.time() - t0, 1e-9):.0f}")
        return p, update

    t_gen = time.time()
    p, upd = gen_progress("generate", len(train_batches))
    with p:
        shards = T.generate_shards(target, train_batches, gen_dir, gen_tokens, sample_prefix, stop, seed, upd,
                                   seconds=gen_minutes * 60)
    p, upd = gen_progress("held-out", len(eval_batches))
    with p:
        eval_shards = T.generate_shards(target, eval_batches, eval_dir, gen_tokens, 0, stop, seed + 1, upd)
    gen_seconds = time.time() - t_gen
    gen_count = sum(s.tokens.shape[0] for s in shards)
    log(f"data ready: {gen_count} continuations x {gen_tokens} tokens in {gen_seconds:.0f}s (cached runs are instant)")

    # -- training ----------------------------------------------------------------------
    for p_ in drafter.parameters():
        p_.requires_grad_(True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = T.Schedule(lr, warmup=min(50, max(steps // 10, 1)) if steps else 50, steps=steps, seconds=minutes * 60)
    gen = torch.Generator().manual_seed(seed)
    ckpt = work / "checkpoint.pt"
    state = T.TrainState()
    if resume:
        if not ckpt.is_file():
            raise DFlashError(f"--resume: no checkpoint at {ckpt}; run without --resume first")
        state = T.load_checkpoint(ckpt, drafter, opt, gen)
        log(f"resumed at step {state.step} ({state.elapsed / 60:.1f} min trained)")
    weights = T.loss_weights(block_size, gamma)
    eval_prompt_list = [p for p in eval_ids]

    def evaluate(n_prompts: int, final: bool = False) -> dict:
        drafter.eval()
        d = Drafter.from_pretrained(out) if final else drafter
        res = {"step": state.step, "minutes": round(state.elapsed / 60, 2)}
        res.update(T.teacher_forced(target, d, eval_shards, block_size, mask_id, weights, seed=seed))
        res.update(T.real_tau(target, d, eval_prompt_list[:n_prompts], eval_tokens, mask_id, block_size, stop))
        drafter.train()
        return res

    def done() -> bool:
        return state.step >= steps if steps else state.elapsed >= minutes * 60

    total = steps if steps else minutes * 60
    cols = [TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.fields[step]}"),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(), TimeRemainingColumn()]
    order: list[int] = []
    t_last, loss_avg, last_print = time.time(), None, time.time()
    with Progress(*cols, console=console) as prog:
        task = prog.add_task("train", total=total, step=state.step, loss="-", tps="-")
        while not done():
            if not order:
                order = torch.randperm(len(shards), generator=gen).tolist()
            s = shards[order.pop()]
            rows = torch.randperm(s.tokens.shape[0], generator=gen)[:batch]
            seq_index, anc = T.sample_anchors(s, rows, anchors, gen)
            if len(anc) == 0:
                continue
            for g in opt.param_groups:
                g["lr"] = sched(state.step, state.elapsed)
            loss, _, valid = T.draft_step(target, drafter, s.tokens[rows], s.length[rows], seq_index, anc,
                                          block_size, mask_id, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            now = time.time()
            state.elapsed += now - t_last
            t_last = now
            state.step += 1
            state.tokens += int(valid.sum())
            loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
            prog.update(task, completed=state.step if steps else min(state.elapsed, total), step=state.step,
                        loss=f"{loss_avg:.3f}", tps=f"{state.tokens / max(state.elapsed, 1e-9):.0f}")
            if now - last_print > 60:
                last_print = now
                log(f"step {state.step} {state.elapsed / 60:.1f}min loss {loss_avg:.3f} "
                    f"lr {opt.param_groups[0]['lr']:.2e} {state.tokens / state.elapsed:.0f} tok/s")
                state.log.append({"step": state.step, "minutes": round(state.elapsed / 60, 2), "loss": round(loss_avg, 4)})
            if eval_every and state.step % eval_every == 0 and not done():
                res = evaluate(eval_n)
                state.log.append(res)
                log(f"eval step {state.step}: real tau {res['real_tau']} (held-out, {eval_n} prompts), "
                    f"teacher-forced tau {res['tf_tau']}")
                T.save_checkpoint(ckpt, drafter, opt, state, gen)
                _save_drafter(drafter, out, save_dtype)
                t_last = time.time()  # evaluation time is not training time
    T.save_checkpoint(ckpt, drafter, opt, state, gen)
    _save_drafter(drafter, out, save_dtype)

    # -- final: reload what was written and decode for real ----------------------------
    res = evaluate(len(eval_prompt_list), final=True)
    state.log.append(res)
    summary = {
        "target": str(target_dir), "target_layer_ids": taps, "mask_token_id": mask_id, "block_size": block_size,
        "layers": layers, "gamma": gamma, "lr": lr, "batch": batch, "anchors": anchors,
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "sequences": gen_count, "gen_tokens": gen_tokens, "gen_minutes": gen_minutes, "sample_prefix": sample_prefix,
        "generation_seconds": round(gen_seconds, 1), "train_steps": state.step,
        "train_minutes": round(state.elapsed / 60, 2), "supervised_tokens": state.tokens,
        "final": res, "log": state.log,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"done: {state.step} steps in {state.elapsed / 60:.1f} min; held-out real tau {res['real_tau']} "
        f"({len(eval_prompt_list)} prompts, {eval_tokens} new tokens, block {block_size}); "
        f"teacher-forced tau {res['tf_tau']}; acc per position {res['tf_acc'][:6]}...")
    log(f"wrote {out} (z-lab format) and {out / 'training.json'}")
    return summary


# -- demo ----------------------------------------------------------------------------------

DEMO = Path(__file__).resolve().parent.parent / "demo"


def _demo_prompts(prompt: str | None, n: int) -> list[str]:
    if prompt is not None:
        return [prompt]
    path = DEMO / "prompts.jsonl"
    if not path.is_file():
        raise DFlashError(f"{path} is missing; pass --prompt TEXT or restore the repository's demo/ folder")
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()][:n]


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=None, help="where to export (default: a temporary folder)")
@click.option("--prompt", default=None, help="your own prompt (default: held-out prompts from demo/prompts.jsonl)")
@click.option("--prompts", "n_prompts", default=24, show_default=True,
              help="how many held-out prompts to measure (the first 3 are streamed)")
@click.option("--threads", default=1, show_default=True,
              help="ONNX Runtime threads. 1 is fastest for this small pair on a 2-vCPU machine: "
                   "measured with `bench`, 2 threads made the 16-token verify ~1.7x slower")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--pair", type=click.Path(path_type=Path), default=DEMO / "pair", show_default=False,
              help="folder with target/ and draft/ (default: the shipped demo/pair)")
def demo(out, prompt, n_prompts, max_new_tokens, threads, pair):
    """The shipped pair end to end, offline: export -> parity check -> streamed speculative
    decoding on held-out prompts (ONNX Runtime, CPU) -> tau, tokens/s and speedup vs plain decoding.
    """
    import tempfile

    from rich.console import Console
    from rich.table import Table

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    console = Console()
    target_dir, draft_dir = Path(pair) / "target", Path(pair) / "draft"
    for d in (target_dir, draft_dir):
        if not (d / "config.json").is_file():
            raise DFlashError(f"the shipped pair is missing ({d}); restore demo/pair/ or rebuild it with demo/recipe.py")
    texts = _demo_prompts(prompt, n_prompts)
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="dflash-demo-"))
    art = root / "artifact"
    root.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter

    console.rule("[bold]1. export (PyTorch -> ONNX, fp32)")
    from .export.artifact import export_artifact

    t0 = clock()
    export_artifact(target_dir, draft_dir, art, dtype="fp32", max_context=1024, force=True)
    t_export = clock() - t0

    console.rule("[bold]2. parity check (ONNX Runtime vs PyTorch)")
    from .cmd_export import print_report
    from .export.check import run_check

    t0 = clock()
    report = run_check(art, target_dir, draft_dir, prompts=4, max_new_tokens=32)
    print_report(report)
    t_check = clock() - t0
    if not report.passed:
        raise DFlashError(f"the parity check failed for {art}; see the table above")

    console.rule("[bold]3. speculative decoding (ONNX Runtime, CPU, greedy)")
    from tokenizers import Tokenizer

    from .runtime.loop import Generation, generate, stream
    from .runtime.ort import OrtBackend

    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    backend = OrtBackend(art, "cpu", threads=threads)
    warm = tok.encode(texts[0]).ids
    generate(backend, warm, 16, draft=True)  # untimed warm-up of both paths
    generate(backend, warm, 16, draft=False)
    spec: list[Generation] = []
    base: list[Generation] = []
    t0 = clock()
    for i, text in enumerate(texts):
        ids = tok.encode(text).ids
        room = backend.manifest.max_context - len(ids)
        if room < 2:
            raise DFlashError(f"prompt {i + 1} has {len(ids)} tokens; the demo export holds {backend.manifest.max_context}")
        g = Generation()
        if i < 3:  # stream a few; measure the rest quietly
            console.print(f"[dim]--- prompt {i + 1}/{len(texts)} ({len(ids)} tokens) ---[/]")
            console.print(text.rstrip("\n")[-400:], style="dim", markup=False, highlight=False)
            for emitted in stream(backend, ids, min(max_new_tokens, room), out=g):
                console.print(tok.decode(emitted), end="", style="bold green", markup=False, highlight=False, soft_wrap=True)
            console.print()
        else:
            if i == 3:
                console.print(f"[dim]--- prompts 4-{len(texts)}: measured without printing ---[/]")
            for _ in stream(backend, ids, min(max_new_tokens, room), out=g):
                pass
        spec.append(g)
        base.append(generate(backend, ids, min(max_new_tokens, room), draft=False))
    t_gen = clock() - t0

    def rate(gs):
        return sum(len(g.tokens) - 1 for g in gs) / max(sum(g.decode_s for g in gs), 1e-9)

    lengths = [a for g in spec for a in g.acceptance_lengths]
    tau = sum(lengths) / max(len(lengths), 1)
    speedup = rate(spec) / max(rate(base), 1e-9)
    same = all(s.tokens == b.tokens for s, b in zip(spec, base))
    table = Table(title=f"demo: {len(texts)} held-out prompt(s) x {max_new_tokens} new tokens, block {backend.manifest.block_size}, "
                  "ONNX Runtime CPU, greedy", title_justify="left")
    table.add_column("")
    table.add_column("speculative (DFlash)", justify="right")
    table.add_column("plain decoding", justify="right")
    table.add_row("tau (tokens per target call)", f"{tau:.2f}", "1.00")
    table.add_row("tokens/s (decode)", f"{rate(spec):.0f}", f"{rate(base):.0f}")
    table.add_row("speedup", f"{speedup:.2f}x", "1.00x")
    for k in ("prefill", "draft", "verify", "host"):
        table.add_row(f"time: {k} (s)", f"{sum(getattr(g, f'{k}_s') for g in spec):.3f}",
                      f"{sum(getattr(g, f'{k}_s') for g in base):.3f}")
    table.add_row("output identical to plain greedy", "yes" if same else "[red]NO", "")
    console.print(table)
    console.print(f"export {t_export:.0f}s, parity check {t_check:.0f}s, generation {t_gen:.0f}s; artifact in {art}")
    if not same:
        raise DFlashError("speculative output differs from plain greedy decoding: the lossless property is broken")


COMMANDS = [train_draft, demo]
