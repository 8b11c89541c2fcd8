"""Training a DFlash drafter against a frozen target (the library behind `train-draft`).

Data: prompts -> the target's own continuations (train/data.py), cached in shards.
`run_training` is the whole run behind the command, configured by one `TrainConfig`;
precision (fp32 or bf16 autocast) is chosen by measurement (train/speed.py).

One training step takes a few sequences of equal length and, for each:
- takes the frozen target's taps at every position (computed once per sequence and cached,
  train/cache.py);
- runs the drafter's context projection once over the whole sequence (`context_kv`);
- picks many random anchors `a` in the greedy part; each block `[tok[a], MASK, ...]` at
  positions `a..a+K-1` attends to context positions `< a` (the anchor's own features
  do not exist yet at inference) plus its whole block, non-causally;
- the labels are the target's continuation `tok[a+1..a+K-1]`, weighted per position
  by `w_k = exp(-(k-1)/gamma)`: early positions matter most, since one miss ends the round.

The drafter borrows the target's embedding and LM head; both stay frozen.
Only real speculative decoding on held-out prompts (`real_tau`) measures the result;
teacher-forced accuracy per block position is reported beside it as a diagnostic.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..errors import DFlashError
from . import cache as C, data as D, speed as P
from ..models.config import DraftConfig, TargetConfig
from ..models.drafter import Drafter, draft_config_dict, new_drafter
from ..models.generate import speculative_generate
from ..models.target import Target
from .eval import real_tau, teacher_forced
from .forward import block_batch, block_logits, draft_step, sample_anchors  # noqa: F401 (the training API)
from .state import Schedule, TrainState, load_checkpoint, save_checkpoint, save_drafter

# -- the training forward --------------------------------------------------------------


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for the K-1 predicted positions k = 1..K-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


# -- the whole run -----------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Everything `train-draft` takes (see its --help for each field's meaning)."""

    target_dir: Path
    out: Path
    data: list[Path]
    steps: int = 0  # train for N steps ...
    minutes: float = 0.0  # ... or for M minutes of training (in all, across --resume)
    max_total_minutes: float = 0.0  # bound on the whole command's wall time (0: none)
    eval_prompts: Path | None = None
    block_size: int = 16
    layers: int = 1
    target_layer_ids: list[int] | None = None  # default: D.default_taps
    intermediate_size: int | None = None
    gamma: float = 7.0
    lr: float = 1e-3
    warmup: float = 0.05  # fraction of the budget
    batch: int = 8
    anchors: int = 48
    sequences: int = 2048
    gen_minutes: float = 0.0
    gen_tokens: int = 256
    gen_batch: int = 64
    sample_prefix: int = 0
    prompt_max_tokens: int = 160
    mask_token_id: int | None = None
    eval_every: int = 0
    eval_n: int = 8
    eval_tokens: int = 128
    save_dtype: str = "fp32"
    precision: str = "auto"
    gen_precision: str = "auto"
    feature_cache_gb: float = 8.0
    work: Path | None = None
    resume: bool = False
    seed: int = 0
    threads: int = 0

    def check(self) -> None:
        if (self.steps > 0) == (self.minutes > 0):
            raise DFlashError("give exactly one of --steps N or --minutes M")
        if self.block_size < 2:
            raise DFlashError(f"--block-size must be >= 2 (got {self.block_size})")
        if self.max_total_minutes and self.minutes and self.max_total_minutes <= self.minutes:
            raise DFlashError(f"--max-total-minutes {self.max_total_minutes:g} leaves no time beside --minutes "
                              f"{self.minutes:g} of training; raise it or lower --minutes")


def _mins(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def run_training(cfg: TrainConfig, log=print) -> dict:
    """Train a drafter for the target on its own continuations; write OUT (z-lab) and
    OUT/training.json; the final numbers come from the drafter reloaded from OUT."""
    t_start = time.time()
    cfg.check()
    console = Console(stderr=True)
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    target_dir, out = Path(cfg.target_dir), Path(cfg.out)
    work = Path(cfg.work) if cfg.work else out.with_name(out.name + ".work")
    k = cfg.block_size

    # -- the target, and a drafter that fits it ---------------------------------------
    tc = TargetConfig.load(target_dir)
    taps = cfg.target_layer_ids or D.default_taps(tc.num_layers)
    bad = [i for i in taps if not 0 <= i < tc.num_layers]
    if bad:
        raise DFlashError(f"--target-layer-ids {bad} are outside the target's {tc.num_layers} layers (0..{tc.num_layers - 1})")
    tok = D.load_tokenizer(target_dir)
    mask_id = D.resolve_mask_id(target_dir, tok, cfg.mask_token_id, tc.vocab_size)
    target = Target.from_pretrained(target_dir, tap_ids=taps).requires_grad_(False)
    shape = dict(num_layers=cfg.layers, block_size=k, target_layer_ids=taps, mask_token_id=mask_id,
                 intermediate_size=cfg.intermediate_size)
    DraftConfig.from_dict(draft_config_dict(tc, **shape)).check_fits(tc)
    drafter = new_drafter(tc, **shape).train()
    stop = tuple(tc.eos_token_ids)
    log(f"target {target_dir}: {tc.num_layers} layers, hidden {tc.hidden_size}, taps {taps}, mask id {mask_id}")
    ids, eval_ids, _ = C.split_prompts(cfg, tok)

    # -- precision by measurement, then the plan ----------------------------------------
    rows = cfg.batch * cfg.anchors * (k - 1)
    bf16 = P.choose("training", cfg.precision, f"LM-head matmul fwd+bwd {rows}x{tc.hidden_size}x{tc.vocab_size}",
                    lambda b: P.lm_head_probe(rows, tc.hidden_size, tc.vocab_size, b), log) == "bf16"
    probe_ids = torch.randint(2, tc.vocab_size, (min(cfg.gen_batch, len(ids)), 64), generator=torch.Generator().manual_seed(0))
    gen_bf16 = P.choose("generation", cfg.gen_precision, f"8 batched decode steps, batch {len(probe_ids)}",
                        lambda b: D.continue_batch(target, probe_ids, 8, bf16=b), log) == "bf16"
    gen_dir, eval_dir = C.gen_dirs(cfg, work, "bf16" if gen_bf16 else "fp32")
    train_batches = D.bucket_batches(ids, cfg.gen_batch, 8, cfg.prompt_max_tokens, cfg.seed)
    eval_batches = D.bucket_batches(eval_ids, cfg.gen_batch, 1, cfg.prompt_max_tokens, cfg.seed)
    D.continue_batch(target, probe_ids, 4, bf16=gen_bf16)  # warm: a first call cost 5x the next on a loaded machine
    t = time.perf_counter()
    D.continue_batch(target, probe_ids, 24, bf16=gen_bf16)
    step_s = (time.perf_counter() - t) / 24
    t = time.perf_counter()
    g = speculative_generate(target, drafter, eval_ids[0], 16, mask_token_id=mask_id, block_size=k)
    round_s = (time.perf_counter() - t) / max(len(g.acceptance_lengths), 1)
    cached = sum((gen_dir / f"{D.shard_name(i, b)}.pt").is_file() for i, b in enumerate(train_batches))
    plan_gen = (len(train_batches) - cached) * cfg.gen_tokens * step_s * 1.3 + len(eval_batches) * cfg.gen_tokens * step_s
    # at tau 1, with a margin: a trained drafter's rounds cost a little more, shared CPUs vary
    plan_eval = 1.3 * len(eval_ids) * cfg.eval_tokens * round_s + len(eval_batches)
    gen_cap = cfg.gen_minutes * 60 or float("inf")
    total_s = cfg.max_total_minutes * 60
    if total_s:  # generation gets what training and evaluation leave (at least one batch)
        plan_eval = min(plan_eval, max(0.15 * total_s, 30.0))  # the final evaluation stops at the bound
        reserve = (cfg.minutes * 60 if cfg.minutes else total_s / 2) + plan_eval
        gen_cap = min(gen_cap, max(total_s - (time.time() - t_start) - reserve, 1.0))
    plan_gen = min(plan_gen, gen_cap)
    log(f"plan: generate {len(train_batches)} batches x {cfg.gen_batch} continuations x {cfg.gen_tokens} tokens "
        f"({cached} cached) ~{_mins(plan_gen)}; train {f'{cfg.minutes:g} min' if cfg.minutes else f'{cfg.steps} steps'}; "
        f"evaluate {len(eval_ids)} held-out prompts x {cfg.eval_tokens} tokens <= ~{_mins(plan_eval)} "
        f"({f'whole command <= {cfg.max_total_minutes:g} min: evaluation stops at the bound' if total_s else 'bound: tau 1, 30% margin'})")

    # -- data ---------------------------------------------------------------------------
    t0 = time.time()
    # the target's features: captured while generating, keyed by the continuations and the taps
    feats = C.FeatureCache(work / f"feat-{C.key(gen_dir.name, taps)}", target, gen_bf16, cfg.feature_cache_gb * 2**30)
    p, upd = C.progress(console, "generate", len(train_batches))
    with p:
        shards, names, made = D.generate_shards(target, train_batches, gen_dir, cfg.gen_tokens, cfg.sample_prefix, stop,
                                                cfg.seed, upd, seconds=0 if gen_cap == float("inf") else gen_cap,
                                                bf16=gen_bf16, on_features=feats.put)
    p, upd = C.progress(console, "held-out", len(eval_batches))
    with p:
        left = gen_cap - (time.time() - t0) if gen_cap != float("inf") else 0.0
        eval_taps: dict = {}
        eval_shards, eval_names, eval_made = D.generate_shards(
            target, eval_batches, eval_dir, cfg.gen_tokens, 0, stop, cfg.seed + 1, upd, bf16=gen_bf16,
            seconds=max(left, 1e-3) if gen_cap != float("inf") else 0.0, on_features=lambda n, t, c: eval_taps.update({n: t}))
    eval_taps = [eval_taps.get(n) for n in eval_names]  # captured, or None (from the cache: the target runs)
    gen_seconds = time.time() - t0
    gen_count = sum(s.tokens.shape[0] for s in shards)
    cut = sum(n.endswith("-partial") for n in names)
    log(f"data: {gen_count} continuations x {cfg.gen_tokens} tokens ({made} of {len(shards)} batches generated now, "
        f"{len(shards) - made} from the cache in {gen_dir}"
        f"{f'; stopped at {len(shards)} of {len(train_batches)} batches by the time limit' if len(shards) < len(train_batches) else ''}"
        f"{f', the last cut short ({shards[-1].tokens.shape[1] - int(train_batches[len(shards) - 1].shape[1])} tokens; not cached)' if cut else ''}"
        f"; held-out: {eval_made} of {len(eval_shards)} generated) in {gen_seconds:.0f}s")

    # -- training ----------------------------------------------------------------------
    for p_ in drafter.parameters():
        p_.requires_grad_(True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = work / "checkpoint.pt"
    state = TrainState()
    if cfg.resume:
        if not ckpt.is_file():
            raise DFlashError(f"--resume: no checkpoint at {ckpt}; run without --resume first")
        state = load_checkpoint(ckpt, drafter, opt, gen)
        log(f"resumed at step {state.step} ({state.elapsed / 60:.1f} min trained)")
    weights = loss_weights(k, cfg.gamma)
    train_s = cfg.minutes * 60 - state.elapsed if cfg.minutes else float("inf")  # this run's share
    if total_s:
        train_s = min(train_s, total_s - (time.time() - t_start) - plan_eval)
        if train_s < (cfg.minutes * 60 - state.elapsed if cfg.minutes else float("inf")):
            log(f"--max-total-minutes: training gets {_mins(max(train_s, 0))} of this run")
    sched = Schedule(cfg.lr, warmup=cfg.warmup, steps=cfg.steps, seconds=state.elapsed + train_s if cfg.minutes else 0.0)
    initial = None
    if not cfg.resume:  # the held-out loss before training, for training.json's before/after
        initial = teacher_forced(target, drafter, eval_shards, k, mask_id, weights, seed=cfg.seed, autocast=bf16, taps=eval_taps)
        log(f"held-out teacher-forced loss before training: {initial['tf_loss']:.3f}")
    run_t0, run_elapsed0 = time.time(), state.elapsed

    def evaluate(n_prompts: int, final: bool = False, deadline: float = 0.0) -> dict:
        drafter.eval()
        d = Drafter.from_pretrained(out) if final else drafter
        res = {"step": state.step, "minutes": round(state.elapsed / 60, 2)}
        res.update(teacher_forced(target, d, eval_shards, k, mask_id, weights, seed=cfg.seed, autocast=bf16, taps=eval_taps))
        res.update(real_tau(target, d, eval_ids[:n_prompts], cfg.eval_tokens, mask_id, k, stop, deadline))
        drafter.train()
        return res

    def done() -> bool:
        if state.elapsed - run_elapsed0 >= train_s:
            return True
        return state.step >= cfg.steps if cfg.steps else False

    total = cfg.steps if cfg.steps else cfg.minutes * 60
    cols = [TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.fields[step]}"),
            TextColumn("loss {task.fields[loss]}"), TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TimeRemainingColumn()]
    order: list[int] = []
    t_last, loss_avg, last_print = time.time(), None, time.time()
    tokens0 = state.tokens
    with Progress(*cols, console=console) as prog:
        task = prog.add_task("train", total=total, step=state.step, loss="-", lr="-", tps="-")
        while not done():
            if not order:
                order = torch.randperm(len(shards), generator=gen).tolist()
            i = order.pop()
            s = shards[i]
            rows = torch.randperm(s.tokens.shape[0], generator=gen)[: cfg.batch]
            seq_index, anc = sample_anchors(s, rows, cfg.anchors, gen)
            if len(anc) == 0:
                continue
            lr = sched(state.step, state.elapsed)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, _, valid = draft_step(target, drafter, s.tokens[rows], s.length[rows], seq_index, anc, k, mask_id,
                                        weights, bf16, feats.get(names[i], s, rows), correct=False)
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
            tps = (state.tokens - tokens0) / max(state.elapsed - run_elapsed0, 1e-9)
            prog.update(task, completed=state.step if cfg.steps else min(state.elapsed, total), step=state.step,
                        loss=f"{loss_avg:.3f}", lr=f"{lr:.1e}", tps=f"{tps:.0f}")
            if now - last_print > 60:
                last_print = now
                log(f"step {state.step} {state.elapsed / 60:.1f}min loss {loss_avg:.3f} lr {lr:.2e} {tps:.0f} tok/s")
                state.log.append({"step": state.step, "minutes": round(state.elapsed / 60, 2), "loss": round(loss_avg, 4),
                                  "lr": lr, "tokens_per_s": round(tps)})
            if cfg.eval_every and state.step % cfg.eval_every == 0 and not done():
                res = evaluate(cfg.eval_n)
                state.log.append(res)
                log(f"eval step {state.step}: real tau {res['real_tau']} (held-out, {cfg.eval_n} prompts), "
                    f"teacher-forced tau {res['tf_tau']}")
                save_checkpoint(ckpt, drafter, opt, state, gen)
                save_drafter(drafter, out, cfg.save_dtype)
                feats.save()
                t_last = time.time()  # evaluation time is not training time
    train_wall = time.time() - run_t0
    if cfg.steps and state.step < cfg.steps:
        log(f"stopped at step {state.step} of {cfg.steps}: --max-total-minutes reached")
    save_checkpoint(ckpt, drafter, opt, state, gen)
    save_drafter(drafter, out, cfg.save_dtype)
    feats.save()

    # -- final: reload what was written and decode for real ----------------------------
    t0 = time.time()
    res = evaluate(len(eval_ids), final=True, deadline=t_start + total_s if total_s else 0.0)
    eval_seconds = time.time() - t0
    state.log.append(res)
    wall = time.time() - t_start
    tps = (state.tokens - tokens0) / max(state.elapsed - run_elapsed0, 1e-9)
    keep = ("block_size", "layers", "gamma", "lr", "warmup", "batch", "anchors", "gen_tokens", "gen_minutes",
            "sample_prefix", "max_total_minutes")
    summary = {
        "target": str(target_dir), "target_layer_ids": taps, "mask_token_id": mask_id,
        **{f: v for f, v in asdict(cfg).items() if f in keep},
        "precision": "bf16" if bf16 else "fp32", "gen_precision": "bf16" if gen_bf16 else "fp32",
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "sequences": gen_count, "generation_seconds": round(gen_seconds, 1), "train_steps": state.step,
        "train_minutes": round(state.elapsed / 60, 2), "supervised_tokens": state.tokens, "tokens_per_s": round(tps),
        "features": {"captured_rows": feats.captured, "computed_rows": feats.computed, "reused_rows": feats.reused},
        "eval_seconds": round(eval_seconds, 1), "wall_seconds": round(wall, 1),
        "initial": initial, "final": res, "log": state.log,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"done: {state.step} steps, {state.elapsed / 60:.1f} min of training ({tps:.0f} tok/s this run); held-out real "
        f"tau {res['real_tau']} ({res['prompts']}{'' if res['prompts'] == len(eval_ids) else f' of {len(eval_ids)} (--max-total-minutes)'} "
        f"prompts, {cfg.eval_tokens} new tokens, block {k}); "
        f"teacher-forced tau {res['tf_tau']}; acc per position {res['tf_acc'][:6]}...")
    log(f"total wall {_mins(wall)}: generation {gen_seconds:.0f}s, training {train_wall:.0f}s, "
        f"evaluation {eval_seconds:.0f}s, setup {wall - gen_seconds - train_wall - eval_seconds:.0f}s")
    log(f"wrote {out} (z-lab format) and {out / 'training.json'}")
    return summary
