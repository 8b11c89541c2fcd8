"""Training a DFlash drafter against a frozen target (the library behind `train-draft`).

Data: prompts -> the target's own continuations (train/data.py), cached in shards.
`run_training` is the whole run behind the command, configured by one `TrainConfig`.

One training step takes a few sequences of equal length and, for each:
- runs the frozen target once to get its taps at every position;
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

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from ..runtime.errors import DFlashError
from . import data as D
from ..models.generate import speculative_generate
from .data import Shard
from .state import Schedule, TrainState, load_checkpoint, save_checkpoint, save_drafter

# -- the training forward --------------------------------------------------------------


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for the K-1 predicted positions k = 1..K-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_logits(drafter, target, ctx_kv, seq_index: torch.Tensor, block_ids: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits [N, K-1, V] for N blocks, block i over context `ctx_kv[seq_index[i]]` before anchor i.

    The inference computation itself (`Drafter.block`, same layer loop and mask rule), with
    a per-block context mask (`Drafter.block_mask`) instead of a per-block context cache.
    """
    k = block_ids.shape[1]
    ctx = [(kc[seq_index], vc[seq_index]) for kc, vc in ctx_kv]
    positions = anchors[:, None] + torch.arange(k)[None]
    hidden = drafter.block(target.embed(block_ids), positions, ctx, anchors)
    return target.lm_head(hidden[:, 1:]).float()


def sample_anchors(shard: Shard, rows: torch.Tensor, per_seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_index [N], anchors [N]): `per_seq` anchors per row, in [start-1, length-2]."""
    lo = max(shard.start - 1, 0)
    seq_index, anchors = [], []
    for r, row in enumerate(rows.tolist()):
        hi = int(shard.length[row]) - 2  # at least one label after the anchor
        if hi < lo:
            continue
        a = torch.randint(lo, hi + 1, (per_seq,), generator=gen)
        seq_index.append(torch.full((per_seq,), r))
        anchors.append(a)
    if not anchors:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(seq_index), torch.cat(anchors)


def block_batch(tokens: torch.Tensor, length: torch.Tensor, seq_index: torch.Tensor, anchors: torch.Tensor,
                block_size: int, mask_token_id: int):
    """Block ids [N,K] = [anchor, MASK...], labels [N,K-1], valid [N,K-1] (inside the sequence)."""
    k = block_size
    offs = anchors[:, None] + torch.arange(1, k)[None]
    valid = offs < length[seq_index][:, None]
    labels = tokens[seq_index[:, None], offs.clamp(max=tokens.shape[1] - 1)]
    block = torch.full((len(anchors), k), mask_token_id, dtype=torch.long)
    block[:, 0] = tokens[seq_index, anchors]
    return block, labels, valid


def draft_step(target, drafter, tokens: torch.Tensor, length: torch.Tensor, seq_index: torch.Tensor,
               anchors: torch.Tensor, block_size: int, mask_token_id: int, weights: torch.Tensor,
               autocast: bool = True):
    """-> (weighted loss, correct [N,K-1] bool, valid [N,K-1] bool) for blocks at `anchors`."""
    b, t = tokens.shape
    pos = torch.arange(t)[None].expand(b, t)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            _, taps, _ = target(tokens, pos, target.empty_kv(b))  # once per sequence
        ctx_kv = drafter.context_kv(taps, pos)  # once per sequence, shared by all its blocks
        block, labels, valid = block_batch(tokens, length, seq_index, anchors, block_size, mask_token_id)
        logits = block_logits(drafter, target, ctx_kv, seq_index, block, anchors)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    w = weights[None, :] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    return loss, logits.argmax(-1) == labels, valid


def accepted_prefix(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per block: the number of leading correct drafts (a teacher-forced acceptance length - 1)."""
    ok = (correct & valid).int()
    return ok.cumprod(1).sum(1)


# -- evaluation ------------------------------------------------------------------------


@torch.no_grad()
def teacher_forced(target, drafter, shards: list[Shard], block_size: int, mask_token_id: int,
                   weights: torch.Tensor, per_seq: int = 32, seed: int = 0) -> dict:
    """Held-out teacher-forced loss, accuracy per block position and tau on cached continuations."""
    gen = torch.Generator().manual_seed(seed)
    correct = torch.zeros(block_size - 1)
    count = torch.zeros(block_size - 1)
    losses, prefixes = [], []
    for s in shards:
        rows = torch.arange(s.tokens.shape[0])
        seq_index, anchors = sample_anchors(s, rows, per_seq, gen)
        if len(anchors) == 0:
            continue
        loss, ok, valid = draft_step(target, drafter, s.tokens, s.length, seq_index, anchors, block_size,
                                     mask_token_id, weights)
        losses.append(loss.item())
        correct += (ok & valid).sum(0).float()
        count += valid.sum(0).float()
        full = valid.all(1)  # tau only over blocks that fit inside the sequence
        prefixes.append(accepted_prefix(ok, valid)[full].float())
    acc = (correct / count.clamp(min=1)).tolist()
    pre = torch.cat(prefixes) if prefixes else torch.zeros(1)
    return {"tf_loss": float(np.mean(losses)) if losses else float("nan"),
            "tf_acc": [round(a, 4) for a in acc], "tf_tau": round(1 + pre.mean().item(), 3)}


def real_tau(target, drafter, prompts: list[list[int]], max_new_tokens: int, mask_token_id: int,
             block_size: int, stop_ids: tuple[int, ...] = ()) -> dict:
    """Real speculative decoding (the reference generator, greedy) on held-out prompts."""
    lengths, per_prompt = [], []
    for p in prompts:
        g = speculative_generate(target, drafter, p, max_new_tokens, mask_token_id=mask_token_id,
                                 block_size=block_size, stop_token_ids=stop_ids)
        lengths += g.acceptance_lengths
        per_prompt.append(round(g.tau, 2))
    hist = np.bincount(lengths, minlength=block_size + 1)[1:].tolist() if lengths else []
    return {"real_tau": round(float(np.mean(lengths)), 3) if lengths else 0.0, "rounds": len(lengths),
            "per_prompt_tau": per_prompt, "accept_hist": hist}


# -- the whole run -----------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Everything `train-draft` takes (see its --help for each field's meaning)."""

    target_dir: Path
    out: Path
    data: list[Path]
    steps: int = 0  # train for N steps ...
    minutes: float = 0.0  # ... or for M minutes (generation not counted)
    eval_prompts: Path | None = None
    block_size: int = 16
    layers: int = 1
    target_layer_ids: list[int] | None = None  # default: D.default_taps
    intermediate_size: int | None = None
    gamma: float = 7.0
    lr: float = 1e-3
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
    work: Path | None = None
    resume: bool = False
    seed: int = 0
    threads: int = 0

    def check(self) -> None:
        if (self.steps > 0) == (self.minutes > 0):
            raise DFlashError("give exactly one of --steps N or --minutes M")
        if self.block_size < 2:
            raise DFlashError(f"--block-size must be >= 2 (got {self.block_size})")


def _hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _progress(console, name: str, total: int):
    """A rich progress bar over generation batches with a tokens/s column, and its update."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    p = Progress(TextColumn(f"[bold]{name}"), BarColumn(), TextColumn("{task.completed}/{task.total} batches"),
                 TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    task = p.add_task(name, total=total, tps="-")
    t0, made = time.time(), [0]

    def update(i, n, new):
        made[0] += new
        p.update(task, completed=i, tps=f"{made[0] / max(time.time() - t0, 1e-9):.0f}")
    return p, update


def prepare_data(cfg: TrainConfig, target, tok, work: Path, stop: tuple, log, console):
    """-> (training shards, held-out shards, held-out prompt ids, seconds spent generating)."""
    texts = D.read_prompts(list(cfg.data), seed=cfg.seed)
    random.Random(cfg.seed).shuffle(texts)
    if cfg.eval_prompts:
        eval_texts = D.read_prompts([cfg.eval_prompts], seed=cfg.seed)
    else:
        n_eval = max(4, len(texts) // 20)
        if len(texts) <= n_eval:
            raise DFlashError(f"only {len(texts)} prompts in --data; give more data or --eval-prompts")
        texts, eval_texts = texts[n_eval:], texts[:n_eval]
    ids = [e.ids for e in tok.encode_batch(texts[: cfg.sequences])]
    eval_ids = [p for p in (e.ids[-cfg.prompt_max_tokens :] for e in tok.encode_batch(eval_texts)) if p]
    if not eval_ids:
        raise DFlashError("no non-empty held-out prompts")
    train_batches = D.bucket_batches(ids, cfg.gen_batch, 8, cfg.prompt_max_tokens, cfg.seed)
    eval_batches = D.bucket_batches(eval_ids, cfg.gen_batch, 1, cfg.prompt_max_tokens, cfg.seed)
    fp = D.target_fingerprint(Path(cfg.target_dir))
    gen_dir = work / f"gen-{_hash(fp, texts[: cfg.sequences], cfg.gen_tokens, cfg.gen_batch, cfg.sample_prefix, cfg.prompt_max_tokens, cfg.seed)}"
    eval_dir = work / f"eval-{_hash(fp, eval_texts, cfg.gen_tokens, cfg.gen_batch, cfg.prompt_max_tokens)}"
    log(f"data: {sum(len(b) for b in train_batches)} training prompts, {len(eval_ids)} held-out prompts; "
        f"continuations cached in {work}")
    t0 = time.time()
    p, upd = _progress(console, "generate", len(train_batches))
    with p:
        shards = D.generate_shards(target, train_batches, gen_dir, cfg.gen_tokens, cfg.sample_prefix, stop, cfg.seed,
                                   upd, seconds=cfg.gen_minutes * 60)
    p, upd = _progress(console, "held-out", len(eval_batches))
    with p:
        eval_shards = D.generate_shards(target, eval_batches, eval_dir, cfg.gen_tokens, 0, stop, cfg.seed + 1, upd)
    return shards, eval_shards, eval_ids, time.time() - t0


def run_training(cfg: TrainConfig, log=print) -> dict:
    """Train a drafter for the target on its own continuations; write OUT (z-lab) and
    OUT/training.json; the final numbers come from the drafter reloaded from OUT."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from ..models.config import DraftConfig, TargetConfig
    from ..models.drafter import Drafter, draft_config_dict, new_drafter
    from ..models.target import Target

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
    shards, eval_shards, eval_ids, gen_seconds = prepare_data(cfg, target, tok, work, stop, log, console)
    gen_count = sum(s.tokens.shape[0] for s in shards)
    log(f"data ready: {gen_count} continuations x {cfg.gen_tokens} tokens in {gen_seconds:.0f}s (cached runs are instant)")

    # -- training ----------------------------------------------------------------------
    for p_ in drafter.parameters():
        p_.requires_grad_(True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = min(50, max(cfg.steps // 10, 1)) if cfg.steps else 50
    sched = Schedule(cfg.lr, warmup=warmup, steps=cfg.steps, seconds=cfg.minutes * 60)
    gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = work / "checkpoint.pt"
    state = TrainState()
    if cfg.resume:
        if not ckpt.is_file():
            raise DFlashError(f"--resume: no checkpoint at {ckpt}; run without --resume first")
        state = load_checkpoint(ckpt, drafter, opt, gen)
        log(f"resumed at step {state.step} ({state.elapsed / 60:.1f} min trained)")
    weights = loss_weights(k, cfg.gamma)

    def evaluate(n_prompts: int, final: bool = False) -> dict:
        drafter.eval()
        d = Drafter.from_pretrained(out) if final else drafter
        res = {"step": state.step, "minutes": round(state.elapsed / 60, 2)}
        res.update(teacher_forced(target, d, eval_shards, k, mask_id, weights, seed=cfg.seed))
        res.update(real_tau(target, d, eval_ids[:n_prompts], cfg.eval_tokens, mask_id, k, stop))
        drafter.train()
        return res

    def done() -> bool:
        return state.step >= cfg.steps if cfg.steps else state.elapsed >= cfg.minutes * 60

    total = cfg.steps if cfg.steps else cfg.minutes * 60
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
            rows = torch.randperm(s.tokens.shape[0], generator=gen)[: cfg.batch]
            seq_index, anc = sample_anchors(s, rows, cfg.anchors, gen)
            if len(anc) == 0:
                continue
            for g in opt.param_groups:
                g["lr"] = sched(state.step, state.elapsed)
            loss, _, valid = draft_step(target, drafter, s.tokens[rows], s.length[rows], seq_index, anc, k, mask_id, weights)
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
            prog.update(task, completed=state.step if cfg.steps else min(state.elapsed, total), step=state.step,
                        loss=f"{loss_avg:.3f}", tps=f"{state.tokens / max(state.elapsed, 1e-9):.0f}")
            if now - last_print > 60:
                last_print = now
                log(f"step {state.step} {state.elapsed / 60:.1f}min loss {loss_avg:.3f} "
                    f"lr {opt.param_groups[0]['lr']:.2e} {state.tokens / state.elapsed:.0f} tok/s")
                state.log.append({"step": state.step, "minutes": round(state.elapsed / 60, 2), "loss": round(loss_avg, 4)})
            if cfg.eval_every and state.step % cfg.eval_every == 0 and not done():
                res = evaluate(cfg.eval_n)
                state.log.append(res)
                log(f"eval step {state.step}: real tau {res['real_tau']} (held-out, {cfg.eval_n} prompts), "
                    f"teacher-forced tau {res['tf_tau']}")
                save_checkpoint(ckpt, drafter, opt, state, gen)
                save_drafter(drafter, out, cfg.save_dtype)
                t_last = time.time()  # evaluation time is not training time
    save_checkpoint(ckpt, drafter, opt, state, gen)
    save_drafter(drafter, out, cfg.save_dtype)

    # -- final: reload what was written and decode for real ----------------------------
    res = evaluate(len(eval_ids), final=True)
    state.log.append(res)
    keep = ("block_size", "layers", "gamma", "lr", "batch", "anchors", "gen_tokens", "gen_minutes", "sample_prefix")
    summary = {
        "target": str(target_dir), "target_layer_ids": taps, "mask_token_id": mask_id,
        **{f: v for f, v in asdict(cfg).items() if f in keep},
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "sequences": gen_count, "generation_seconds": round(gen_seconds, 1), "train_steps": state.step,
        "train_minutes": round(state.elapsed / 60, 2), "supervised_tokens": state.tokens,
        "final": res, "log": state.log,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"done: {state.step} steps in {state.elapsed / 60:.1f} min; held-out real tau {res['real_tau']} "
        f"({len(eval_ids)} prompts, {cfg.eval_tokens} new tokens, block {k}); "
        f"teacher-forced tau {res['tf_tau']}; acc per position {res['tf_acc'][:6]}...")
    log(f"wrote {out} (z-lab format) and {out / 'training.json'}")
    return summary
