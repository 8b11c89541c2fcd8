"""`dflash-export train-draft`: train a DFlash drafter for a target, on the target's own text.

The options become one `train.train.TrainConfig`; `train.train.run_training` does the run.
Heavy imports (torch, models) are lazy (lazy.py) so the CLI starts fast.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..errors import DFlashError
from ..lazy import lazy_import
from .. import sources

train = lazy_import("dflash_export.train.train")  # torch: only when the command runs


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


@click.command("train-draft")
@click.option("--target", "target_dir", required=True, metavar="DIR|ID",
              help="HF target checkpoint (with tokenizer.json): a directory or a Hugging Face id, org/name[@revision]")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="drafter directory to write (z-lab format)")
@click.option("--data", multiple=True, required=True, type=click.Path(path_type=Path),
              help="text files or JSONL prompts: --data a.py b.py (a shell glob works) or repeated --data")
@click.argument("more_data", nargs=-1, type=click.Path(path_type=Path), metavar="[MORE_DATA_FILES]...")
@click.option("--eval-prompts", type=click.Path(path_type=Path), default=None, help="held-out prompts (default: 5% of --data)")
@click.option("--block-size", default=16, show_default=True)
@click.option("--layers", default=1, show_default=True, type=click.IntRange(1, 8), help="drafter depth (1-8)")
@click.option("--target-layer-ids", default=None, help="taps, e.g. 1,3,4 (default: up to 5 spread over [1, L-2])")
@click.option("--intermediate-size", default=None, type=int, help="drafter MLP width (default: the target's)")
@click.option("--gamma", default=7.0, show_default=True, help="loss weight decay: w_k = exp(-(k-1)/gamma)")
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--batch", default=8, show_default=True, help="sequences per step")
@click.option("--anchors", default=48, show_default=True, help="random anchors (blocks) per sequence")
@click.option("--steps", default=0, help="train for N steps ...")
@click.option("--minutes", default=0.0,
              help="... or for M minutes of training (in all, across --resume; generation and evaluation not counted)")
@click.option("--max-total-minutes", default=0.0, help="bound the whole command (generation + training + evaluation); 0: none")
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="training matmuls: fp32 or bf16 autocast; auto: the faster, measured once per machine")
@click.option("--gen-precision", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="the target's continuation generation, chosen the same way (bf16 flips a few near-tie labels)")
@click.option("--warmup", default=0.05, show_default=True, help="LR warmup as a fraction of the budget (steps or minutes)")
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
@click.option("--family", type=click.Choice(["dflash", "dflash2"]), default="dflash", show_default=True,
              help="drafter family to train (only dflash: DFlash 2 training is not supported)")
def train_draft(target_dir, out, data, more_data, eval_prompts, block_size, layers, target_layer_ids, intermediate_size,
                gamma, lr, batch, anchors, steps, minutes, max_total_minutes, precision, gen_precision, warmup, sequences,
                gen_minutes, gen_tokens, gen_batch, sample_prefix, prompt_max_tokens, mask_token_id, eval_every, eval_n,
                eval_tokens, save_dtype, work, resume, seed, threads, family):
    """Train a DFlash drafter on the target's own continuations of --data; writes a z-lab drafter.

    The target is frozen; the drafter borrows its embedding and LM head. At the end the
    drafter is reloaded from OUT and measured by real speculative decoding on held-out prompts.
    --data takes several files (`--data a.py b.py`, a glob, or --data repeated).
    """
    if family == "dflash2":  # the official objective for the candidate selector is unreleased
        raise DFlashError("train-draft trains DFlash drafters only: training DFlash2 drafters (selector, convolutions) "
                          "is not supported; use --family dflash")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    target_dir = sources.resolve(target_dir, what="target").path
    train.run_training(train.TrainConfig(
        target_dir, out, list(data) + list(more_data), steps=steps, minutes=minutes,
        max_total_minutes=max_total_minutes, precision=precision, gen_precision=gen_precision, warmup=warmup,
        eval_prompts=eval_prompts, block_size=block_size,
        layers=layers, target_layer_ids=parse_layer_ids(target_layer_ids), intermediate_size=intermediate_size,
        gamma=gamma, lr=lr, batch=batch, anchors=anchors, sequences=sequences, gen_minutes=gen_minutes,
        gen_tokens=gen_tokens, gen_batch=gen_batch, sample_prefix=sample_prefix, prompt_max_tokens=prompt_max_tokens,
        mask_token_id=mask_token_id, eval_every=eval_every, eval_n=eval_n, eval_tokens=eval_tokens,
        save_dtype=save_dtype, work=work, resume=resume, seed=seed, threads=threads,
    ))


COMMANDS = [train_draft]
