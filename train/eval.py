"""Evaluating a drafter in training: teacher-forced accuracy and real speculative decoding.

Only real speculative decoding on held-out prompts (`real_tau`) measures a drafter; the
teacher-forced numbers are a diagnostic (uniform anchors overweight easy stretches).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..models.generate import speculative_generate
from .forward import draft_step, sample_anchors
from .data import Shard


def accepted_prefix(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per block: the number of leading correct drafts (a teacher-forced acceptance length - 1)."""
    ok = (correct & valid).int()
    return ok.cumprod(1).sum(1)


# -- evaluation ------------------------------------------------------------------------


@torch.no_grad()
def teacher_forced(target, drafter, shards: list[Shard], block_size: int, mask_token_id: int,
                   weights: torch.Tensor, per_seq: int = 32, seed: int = 0, autocast: bool = False,
                   taps: list | None = None) -> dict:
    """Held-out teacher-forced loss, accuracy per block position and tau on cached continuations;
    `taps[i]`: shard i's captured target features (None: the target runs)."""
    gen = torch.Generator().manual_seed(seed)
    correct = torch.zeros(block_size - 1)
    count = torch.zeros(block_size - 1)
    losses, prefixes = [], []
    for i, s in enumerate(shards):
        rows = torch.arange(s.tokens.shape[0])
        seq_index, anchors = sample_anchors(s, rows, per_seq, gen)
        if len(anchors) == 0:
            continue
        loss, ok, valid = draft_step(target, drafter, s.tokens, s.length, seq_index, anchors, block_size,
                                     mask_token_id, weights, autocast, taps[i] if taps else None)
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
             block_size: int, stop_ids: tuple[int, ...] = (), deadline: float = 0.0) -> dict:
    """Real speculative decoding (the reference generator, greedy) on held-out prompts; with a
    `deadline` (time.time()), no prompt starts after it (at least one runs): `prompts` says how many ran."""
    lengths, per_prompt = [], []
    for p in prompts:
        if deadline and per_prompt and time.time() > deadline:
            break
        g = speculative_generate(target, drafter, p, max_new_tokens, mask_token_id=mask_token_id,
                                 block_size=block_size, stop_token_ids=stop_ids)
        lengths += g.acceptance_lengths
        per_prompt.append(round(g.tau, 2))
    hist = np.bincount(lengths, minlength=block_size + 1)[1:].tolist() if lengths else []
    return {"real_tau": round(float(np.mean(lengths)), 3) if lengths else 0.0, "rounds": len(lengths),
            "prompts": len(per_prompt), "per_prompt_tau": per_prompt, "accept_hist": hist}
