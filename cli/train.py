"""`dflash-export train-draft`: train a DFlash drafter for a target, on the target's own text.

The command is generated from `train.config.TrainConfig`, whose fields are its options (one
definition each); the parsed options become that TrainConfig, whole, and
`train.train.run_training` does the run. torch is imported only when the command runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..export import sources
from ..runtime.lazy import lazy_import
from .options import field_options
from ..train.config import TrainConfig

train = lazy_import("dflash_export.train.train")  # torch: only when the command runs


@click.command("train-draft")
@field_options(TrainConfig)
@click.argument("more_data", nargs=-1, type=click.Path(path_type=Path), metavar="[MORE_DATA_FILES]...")
def train_draft(more_data, **options):
    """Train a DFlash drafter on the target's own continuations of --data; writes a z-lab drafter.

    The target is frozen; the drafter borrows its embedding and LM head. At the end the
    drafter is reloaded from OUT and measured by real speculative decoding on held-out prompts.
    --data takes several files (`--data a.py b.py`, a glob, or --data repeated).
    """
    cfg = TrainConfig(**{**options, "data": list(options["data"]) + list(more_data)})
    cfg.check()  # before the target is looked up
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cfg.target_dir = sources.resolve(cfg.target_dir, what="target").path
    train.run_training(cfg)


COMMANDS = [train_draft]
