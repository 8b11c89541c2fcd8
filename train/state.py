"""What a training run keeps: the LR schedule, its progress, resumable checkpoints, the drafter it writes."""

from __future__ import annotations

import copy
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..runtime.errors import DFlashError
from ..runtime.outdir import commit, staged


@dataclass
class Schedule:
    """Linear warmup over the first `warmup` fraction of the budget, then cosine to 10% at its end.

    The budget is `steps`, or `seconds` of training when `steps` is 0: both derive from it, so a
    2-minute run leaves warmup after 6 s and a 2-hour run after 6 min.
    """

    lr: float
    warmup: float = 0.05
    steps: int = 0
    seconds: float = 0.0

    def fraction(self, step: int, elapsed: float) -> float:
        return (step + 1) / self.steps if self.steps else elapsed / max(self.seconds, 1e-9)

    def __call__(self, step: int, elapsed: float) -> float:
        f = min(self.fraction(step, elapsed), 1.0)
        warm = min(1.0, max(f, 1e-3) / self.warmup) if self.warmup > 0 else 1.0
        return self.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * f)))


@dataclass
class TrainState:
    step: int = 0
    elapsed: float = 0.0
    tokens: int = 0
    log: list = field(default_factory=list)


def save_checkpoint(path: Path, drafter, opt, state: TrainState, gen: torch.Generator) -> None:
    """Everything to resume, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"drafter": drafter.state_dict(), "opt": opt.state_dict(), "step": state.step,
                "elapsed": state.elapsed, "tokens": state.tokens, "log": state.log,
                "gen": gen.get_state(), "config": drafter.config.raw}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, drafter, opt, gen: torch.Generator) -> TrainState:
    d = torch.load(path, weights_only=False)
    if d["config"] != drafter.config.raw:
        raise DFlashError(f"checkpoint {path} was made with another drafter config; drop --resume or use the same options")
    drafter.load_state_dict(d["drafter"])
    opt.load_state_dict(d["opt"])
    gen.set_state(d["gen"])
    return TrainState(d["step"], d["elapsed"], d["tokens"], d["log"])


def save_drafter(drafter, out: Path, dtype: str) -> None:
    """Write the z-lab directory beside OUT, then swap it in: OUT is never half-written."""
    model = copy.deepcopy(drafter)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
        model.config.raw["dtype"] = model.config.raw["torch_dtype"] = "bfloat16"
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged(out) as tmp:
        model.save_pretrained(tmp)
        if (out / "training.json").is_file():
            shutil.copy(out / "training.json", tmp / "training.json")
        commit(tmp, out)
