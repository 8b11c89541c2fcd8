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

from ..runtime.errors import DFlashError
from . import cache as C, data as D, speed as P
from .config import TrainConfig
from ..models.config import TargetConfig
from ..models.draft_config import DraftConfig
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


def _mins(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


@dataclass
class Pair:
    """The frozen target, a new drafter that fits it, and the prompts both are run on."""

    target: Target
    drafter: Drafter
    tc: TargetConfig
    taps: list[int]
    mask_id: int
    stop: tuple
    ids: list[list[int]]  # training prompts
    eval_ids: list[list[int]]  # held-out prompts


@dataclass
class Plan:
    """Precisions chosen by measurement, the generation batches, and the time each phase may take."""

    bf16: bool  # training matmuls
    gen_bf16: bool  # the target's continuations
    gen_dir: Path
    eval_dir: Path
    train_batches: list
    eval_batches: list
    gen_cap: float  # seconds generation may take (inf: no cap)
    plan_eval: float  # seconds the final evaluation is expected (or allowed) to take
    total_s: float  # --max-total-minutes in seconds (0: no bound)


@dataclass
class Data:
    """The continuations (train/data.py shards) and the target features cached beside them."""

    shards: list
    names: list[str]
    eval_shards: list
    eval_names: list[str]
    eval_taps: list
    feats: C.FeatureCache
    seconds: float
    count: int  # training continuations


@dataclass
class Trained:
    """What the optimisation loop leaves for the final evaluation and training.json."""

    state: TrainState
    initial: dict | None  # held-out numbers before training (None: resumed)
    weights: torch.Tensor  # the loss weights per block position
    wall: float  # seconds this run trained (evaluations included)
    tokens_per_s: float  # supervised tokens per second of this run's training


def run_training(cfg: TrainConfig, log=print) -> dict:
    """Train a drafter for the target on its own continuations; write OUT (z-lab) and
    OUT/training.json; the final numbers come from the drafter reloaded from OUT."""
    t_start = time.time()
    cfg.check()
    console = Console(stderr=True)
    torch.set_num_threads(cfg.torch_threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    work = Path(cfg.work) if cfg.work else out.with_name(out.name + ".work")
    pair = load_pair(cfg, log)
    plan = plan_run(cfg, pair, work, t_start, log)
    data = generate_data(cfg, pair, plan, work, console, log)
    run = train(cfg, pair, plan, data, work, t_start, console, log)
    t0 = time.time()  # final: reload what was written and decode for real
    res = evaluate(cfg, pair, data, run.state, run.weights, plan.bf16, len(pair.eval_ids), final=True,
                   deadline=t_start + plan.total_s if plan.total_s else 0.0)
    run.state.log.append(res)
    return write_summary(cfg, pair, plan, data, run, res, t_start, time.time() - t0, log)


def load_pair(cfg: TrainConfig, log) -> Pair:
    """The target, a new drafter that fits it (taps, mask token, depth checked) and the prompts."""
    target_dir, k = Path(cfg.target_dir), cfg.block_size
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
    if cfg.init:  # a warm restart: the weights of a finished drafter of the same shape
        start = Drafter.from_pretrained(Path(cfg.init))
        if start.config.raw != drafter.config.raw:
            raise DFlashError(f"--init {cfg.init}: its config differs from the drafter these options make "
                              "(block size, depth, taps, mask token); give the options it was trained with")
        drafter.load_state_dict(start.state_dict())
        log(f"initialised from {cfg.init}")
    log(f"target {target_dir}: {tc.num_layers} layers, hidden {tc.hidden_size}, taps {taps}, mask id {mask_id}")
    ids, eval_ids, _ = C.split_prompts(cfg, tok)
    return Pair(target, drafter, tc, taps, mask_id, tuple(tc.eos_token_ids), ids, eval_ids)


def plan_run(cfg: TrainConfig, pair: Pair, work: Path, t_start: float, log) -> Plan:
    """Precision by measurement, then what each phase will cost: a decode step and a drafted
    round timed here, generation capped by what training and evaluation leave of the bound."""
    target, tc, k, ids, eval_ids = pair.target, pair.tc, cfg.block_size, pair.ids, pair.eval_ids
    rows = cfg.train_batch * cfg.anchors * (k - 1)
    bf16 = P.choose("training", cfg.train_precision, f"LM-head matmul fwd+bwd {rows}x{tc.hidden_size}x{tc.vocab_size}",
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
    g = speculative_generate(target, pair.drafter, eval_ids[0], 16, mask_token_id=pair.mask_id, block_size=k)
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
    return Plan(bf16, gen_bf16, gen_dir, eval_dir, train_batches, eval_batches, gen_cap, plan_eval, total_s)


def generate_data(cfg: TrainConfig, pair: Pair, plan: Plan, work: Path, console, log) -> Data:
    """The target's continuations of the training and held-out prompts (cached shards), its
    features captured on the way (keyed by the continuations and the taps)."""
    t0, target, gen_cap = time.time(), pair.target, plan.gen_cap
    feats = C.FeatureCache(work / f"feat-{C.key(plan.gen_dir.name, pair.taps)}", target, plan.gen_bf16,
                           cfg.feature_cache_gb * 2**30)
    p, upd = C.progress(console, "generate", len(plan.train_batches))
    with p:
        shards, names, made = D.generate_shards(target, plan.train_batches, plan.gen_dir, cfg.gen_tokens, cfg.sample_prefix,
                                                pair.stop, cfg.seed, upd, seconds=0 if gen_cap == float("inf") else gen_cap,
                                                bf16=plan.gen_bf16, on_features=feats.put)
    p, upd = C.progress(console, "held-out", len(plan.eval_batches))
    with p:
        left = gen_cap - (time.time() - t0) if gen_cap != float("inf") else 0.0
        eval_taps: dict = {}
        eval_shards, eval_names, eval_made = D.generate_shards(
            target, plan.eval_batches, plan.eval_dir, cfg.gen_tokens, 0, pair.stop, cfg.seed + 1, upd, bf16=plan.gen_bf16,
            seconds=max(left, 1e-3) if gen_cap != float("inf") else 0.0, on_features=lambda n, t, c: eval_taps.update({n: t}))
    data = Data(shards, names, eval_shards, eval_names, [eval_taps.get(n) for n in eval_names],  # None: from the cache
                feats, time.time() - t0, sum(s.tokens.shape[0] for s in shards))
    train_batches, cut = plan.train_batches, sum(n.endswith("-partial") for n in names)
    log(f"data: {data.count} continuations x {cfg.gen_tokens} tokens ({made} of {len(shards)} batches generated now, "
        f"{len(shards) - made} from the cache in {plan.gen_dir}"
        f"{f'; stopped at {len(shards)} of {len(train_batches)} batches by the time limit' if len(shards) < len(train_batches) else ''}"
        f"{f', the last cut short ({shards[-1].tokens.shape[1] - int(train_batches[len(shards) - 1].shape[1])} tokens; not cached)' if cut else ''}"
        f"; held-out: {eval_made} of {len(eval_shards)} generated) in {data.seconds:.0f}s")
    return data


def evaluate(cfg: TrainConfig, pair: Pair, data: Data, state: TrainState, weights, bf16: bool, n_prompts: int,
             final: bool = False, deadline: float = 0.0) -> dict:
    """Teacher-forced numbers on the held-out continuations and real tau on `n_prompts` held-out
    prompts; final: of the drafter reloaded from OUT (what was written)."""
    drafter = pair.drafter
    drafter.eval()
    d = Drafter.from_pretrained(Path(cfg.out)) if final else drafter
    res = {"step": state.step, "minutes": round(state.elapsed / 60, 2)}
    res.update(teacher_forced(pair.target, d, data.eval_shards, cfg.block_size, pair.mask_id, weights, seed=cfg.seed,
                              autocast=bf16, taps=data.eval_taps))
    res.update(real_tau(pair.target, d, pair.eval_ids[:n_prompts], cfg.eval_tokens, pair.mask_id, cfg.block_size,
                        pair.stop, deadline))
    drafter.train()
    return res


def train(cfg: TrainConfig, pair: Pair, plan: Plan, data: Data, work: Path, t_start: float, console, log) -> Trained:
    """The optimisation loop (resumed from --work's checkpoint with --resume) until the steps or
    minutes are done or the bound leaves only the final evaluation's time; the drafter saved to
    OUT."""
    target, drafter, k, mask_id, out = pair.target, pair.drafter, cfg.block_size, pair.mask_id, Path(cfg.out)
    shards, names, feats, bf16, total_s = data.shards, data.names, data.feats, plan.bf16, plan.total_s
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
        train_s = min(train_s, total_s - (time.time() - t_start) - plan.plan_eval)
        if train_s < (cfg.minutes * 60 - state.elapsed if cfg.minutes else float("inf")):
            log(f"--max-total-minutes: training gets {_mins(max(train_s, 0))} of this run")
    sched = Schedule(cfg.lr, warmup=cfg.lr_warmup, steps=cfg.steps, seconds=state.elapsed + train_s if cfg.minutes else 0.0)
    initial = None
    if not cfg.resume:  # the held-out loss before training, for training.json's before/after
        initial = teacher_forced(target, drafter, data.eval_shards, k, mask_id, weights, seed=cfg.seed, autocast=bf16,
                                 taps=data.eval_taps)
        log(f"held-out teacher-forced loss before training: {initial['tf_loss']:.3f}")
    run_t0, run_elapsed0 = time.time(), state.elapsed

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
            rows = torch.randperm(s.tokens.shape[0], generator=gen)[: cfg.train_batch]
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
                res = evaluate(cfg, pair, data, state, weights, bf16, cfg.eval_n)
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
    return Trained(state, initial, weights, train_wall, (state.tokens - tokens0) / max(state.elapsed - run_elapsed0, 1e-9))


def write_summary(cfg: TrainConfig, pair: Pair, plan: Plan, data: Data, run: Trained, res: dict, t_start: float,
                  eval_seconds: float, log) -> dict:
    """OUT/training.json (the settings, the data, the run, before/after numbers) and the closing lines."""
    out, k, feats, eval_ids = Path(cfg.out), cfg.block_size, data.feats, pair.eval_ids
    state, initial, train_wall, tps = run.state, run.initial, run.wall, run.tokens_per_s
    wall = time.time() - t_start
    keep = ("block_size", "layers", "gamma", "lr", "lr_warmup", "train_batch", "anchors", "gen_tokens", "gen_minutes",
            "sample_prefix", "max_total_minutes")
    summary = {
        "target": str(cfg.target_dir), "target_layer_ids": pair.taps, "mask_token_id": pair.mask_id,
        **{f: v for f, v in asdict(cfg).items() if f in keep},
        "precision": "bf16" if plan.bf16 else "fp32", "gen_precision": "bf16" if plan.gen_bf16 else "fp32",
        "drafter_params": sum(p.numel() for p in pair.drafter.parameters()),
        "sequences": data.count, "generation_seconds": round(data.seconds, 1), "train_steps": state.step,
        "train_minutes": round(state.elapsed / 60, 2), "supervised_tokens": state.tokens, "tokens_per_s": round(tps),
        "features": {"captured_rows": feats.captured, "computed_rows": feats.computed, "reused_rows": feats.reused},
        "eval_seconds": round(eval_seconds, 1), "wall_seconds": round(wall, 1),
        "initial": initial, "final": res, "log": state.log,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    gen_seconds = data.seconds
    log(f"done: {state.step} steps, {state.elapsed / 60:.1f} min of training ({tps:.0f} tok/s this run); held-out real "
        f"tau {res['real_tau']} ({res['prompts']}{'' if res['prompts'] == len(eval_ids) else f' of {len(eval_ids)} (--max-total-minutes)'} "
        f"prompts, {cfg.eval_tokens} new tokens, block {k}); "
        f"teacher-forced tau {res['tf_tau']}; acc per position {res['tf_acc'][:6]}...")
    log(f"total wall {_mins(wall)}: generation {gen_seconds:.0f}s, training {train_wall:.0f}s, "
        f"evaluation {eval_seconds:.0f}s, setup {wall - gen_seconds - train_wall - eval_seconds:.0f}s")
    log(f"wrote {out} (z-lab format) and {out / 'training.json'}")
    return summary
