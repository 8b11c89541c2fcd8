"""Everything `train-draft` takes, defined once: `TrainConfig`'s fields are the command's options.

Each field's metadata holds its option's help and click settings; cli/train.py generates the
command from them (`--name-with-dashes` per field), so an option is added, renamed or given a
new default here and nowhere else. A field without metadata is set from code only. torch-free:
the CLI imports it to build `--help`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import click

from ..runtime.errors import DFlashError
from ..runtime.options import option

PRECISIONS = click.Choice(["auto", "fp32", "bf16"])


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


@dataclass
class TrainConfig:
    """A training run (see `dflash-export train-draft --help` for each field's meaning)."""

    target_dir: Path = option(required=True, metavar="DIR|ID", opt="--target",
                              help="HF target checkpoint (with tokenizer.json): a directory or a Hugging Face id, "
                                   "org/name[@revision]")
    out: Path = option(required=True, type=click.Path(path_type=Path), help="drafter directory to write (z-lab format)")
    data: list[Path] = option(multiple=True, required=True, type=click.Path(path_type=Path),
                              help="text files or JSONL prompts: --data a.py b.py (a shell glob works) or repeated --data")
    eval_prompts: Path | None = option(None, "held-out prompts (default: 5% of --data)", type=click.Path(path_type=Path))
    block_size: int = option(16, show_default=True)
    layers: int = option(1, "drafter depth (1-8)", show_default=True, type=click.IntRange(1, 8))
    target_layer_ids: list[int] | None = option(None, "taps, e.g. 1,3,4 (default: up to 5 spread over [1, L-2])",
                                                type=str, callback=lambda ctx, p, v: parse_layer_ids(v))
    intermediate_size: int | None = option(None, "drafter MLP width (default: the target's)", type=int)
    gamma: float = option(7.0, "loss weight decay: w_k = exp(-(k-1)/gamma)", show_default=True)
    lr: float = option(1e-3, show_default=True)
    train_batch: int = option(8, "sequences per optimizer step", show_default=True, old=("--batch",))
    anchors: int = option(48, "random anchors (blocks) per sequence", show_default=True)
    steps: int = option(0, "train for N steps ...")
    minutes: float = option(0.0, "... or for M minutes of training (in all, across --resume; generation and "
                                 "evaluation not counted)")
    max_total_minutes: float = option(0.0, "bound the whole command (generation + training + evaluation); 0: none")
    train_precision: str = option("auto", "training matmuls: fp32 or bf16 autocast; auto: the faster, measured once "
                                          "per machine", type=PRECISIONS, show_default=True,
                                  old=("--precision",))
    gen_precision: str = option("auto", "the target's continuation generation, chosen the same way (bf16 flips a "
                                        "few near-tie labels)", type=PRECISIONS, show_default=True)
    lr_warmup: float = option(0.05, "LR warmup as a fraction of the budget (steps or minutes)", show_default=True,
                              old=("--warmup",))
    sequences: int = option(2048, "continuations to generate (cached)", show_default=True)
    gen_minutes: float = option(0.0, "stop generating new continuations after M minutes (0: all --sequences)")
    gen_tokens: int = option(256, "new tokens per continuation", show_default=True)
    gen_batch: int = option(64, "prompts per batched generation pass", show_default=True)
    sample_prefix: int = option(0, "half the batches: sample this many tokens before the greedy part (diversity)",
                                show_default=True)
    prompt_max_tokens: int = option(160, show_default=True)
    mask_token_id: int | None = option(None, "default: the tokenizer's mask token", type=int)
    eval_every: int = option(0, "real tau + teacher-forced eval every N steps (0: only at the end)")
    eval_n: int = option(8, "held-out prompts for the periodic eval", show_default=True)
    eval_tokens: int = option(128, "new tokens per held-out prompt", show_default=True)
    save_dtype: str = option("fp32", type=click.Choice(["fp32", "bf16"]), show_default=True)
    work: Path | None = option(None, "cache + checkpoint folder (default OUT.work)", type=click.Path(path_type=Path))
    resume: bool = option(False, "continue from the last checkpoint in --work", is_flag=True)
    init: Path | None = option(None, "start from this drafter's weights (same shape; a fresh optimizer and "
                                     "schedule): a warm restart of a finished run", type=click.Path(path_type=Path))
    seed: int = option(0, show_default=True)
    torch_threads: int = option(0, "torch threads (default: all cores)", old=("--threads",))
    family: str = option("dflash", "drafter family to train (only dflash: DFlash 2 training is not supported)",
                         type=click.Choice(["dflash", "dflash2"]), show_default=True)
    feature_cache_gb: float = 8.0  # the target's taps cached on disk per run (train/cache.py)

    def check(self) -> None:
        if self.family == "dflash2":  # the official objective for the candidate selector is unreleased
            raise DFlashError("train-draft trains DFlash drafters only: training DFlash2 drafters (selector, "
                              "convolutions) is not supported; use --family dflash")
        for name, value in (("--steps", self.steps), ("--minutes", self.minutes)):
            if value < 0:
                raise DFlashError(f"{name} must be > 0 (got {value:g})")
        if self.steps > 0 and self.minutes > 0:
            raise DFlashError(f"give --steps N or --minutes M, not both (got --steps {self.steps} --minutes {self.minutes:g})")
        if self.steps == 0 and self.minutes == 0:
            raise DFlashError("--steps 0 and --minutes 0 train for nothing: give --steps N (N >= 1) or --minutes M (M > 0)")
        if self.init and self.resume:
            raise DFlashError("give --init DRAFT_DIR or --resume, not both (--resume continues --work's checkpoint)")
        if self.block_size < 2:
            raise DFlashError(f"--block-size must be >= 2 (got {self.block_size})")
        if self.max_total_minutes and self.minutes and self.max_total_minutes <= self.minutes:
            raise DFlashError(f"--max-total-minutes {self.max_total_minutes:g} leaves no time beside --minutes "
                              f"{self.minutes:g} of training; raise it or lower --minutes")
