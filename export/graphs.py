"""The three exported graphs as flat-tensor torch modules over `models/`, with their tracing inputs.

Each wrapper maps the contract's tensor names (runtime/contract.py) onto one call of the
reference modules, so the ONNX graphs compute exactly what the PyTorch oracle computes.
Sample sizes for tracing are all >= 2 and pairwise distinct: torch.export specialises a
dim of size 0 or 1 and may merge dims whose sample sizes coincide; the graphs are then
checked at past length 0 and sequence length 1 after export (export/check.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime import contract as C

BATCH, SEQ, PAST, CTX, PAST_CTX = "batch", "seq", "past", "ctx", "past_ctx"


def _pairs(flat: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]


def _flat(pairs) -> list[torch.Tensor]:
    return [t for kv in pairs for t in kv]


class TargetGraph(nn.Module):
    """input_ids, position_ids, past K/V -> logits (fp32), next_ids, taps, new K/V."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def forward(self, input_ids, position_ids, *past):
        logits, taps, new = self.target(input_ids, position_ids, _pairs(past))
        return (logits, logits.argmax(-1), taps, *_flat(new))


class DraftContextGraph(nn.Module):
    """taps of newly accepted positions -> drafter context K/V to append."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, taps, ctx_position_ids):
        return tuple(_flat(self.drafter.context_kv(taps, ctx_position_ids)))


class SharedHead(nn.Module):
    """The target's embedding and LM head alone, so the block graph carries no other target weight."""

    def __init__(self, target):
        super().__init__()
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head

    def embed(self, ids):
        return self.embed_tokens(ids)


class DraftBlockGraph(nn.Module):
    """block ids + positions over the drafter's context cache -> draft_ids, draft_logits (fp32)."""

    def __init__(self, drafter, target):
        super().__init__()
        self.drafter = drafter
        self.shared = SharedHead(target)

    def forward(self, block_ids, block_position_ids, *past_ctx):
        logits = self.drafter.draft_logits(self.shared, block_ids, block_position_ids, _pairs(past_ctx))
        return logits.argmax(-1), logits


def target_names(layers: int) -> tuple[list[str], list[str]]:
    kv_in = [n for i in range(layers) for n in (C.past_key(i), C.past_value(i))]
    kv_out = [n for i in range(layers) for n in (C.new_key(i), C.new_value(i))]
    return ["input_ids", "position_ids", *kv_in], ["logits", "next_ids", "taps", *kv_out]


def context_names(layers: int) -> tuple[list[str], list[str]]:
    return ["taps", "ctx_position_ids"], [n for j in range(layers) for n in (C.ctx_key(j), C.ctx_value(j))]


def block_names(layers: int) -> tuple[list[str], list[str]]:
    kv_in = [n for j in range(layers) for n in (C.past_ctx_key(j), C.past_ctx_value(j))]
    return ["block_ids", "block_position_ids", *kv_in], ["draft_ids", "draft_logits"]


def _sizes(block_size: int) -> dict[str, int]:
    """Distinct tracing sizes >= 2 that also differ from the static block size."""
    free = (n for n in range(2, 64) if n != block_size)
    return {d: next(free) for d in (BATCH, SEQ, PAST, CTX, PAST_CTX)}


def _positions(batch: int, start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n).expand(batch, n).contiguous()


def target_inputs(target, block_size: int):
    """Sample inputs and torch.export dynamic shapes for TargetGraph."""
    c, n = target.config, _sizes(block_size)
    dtype = target.model.embed_tokens.weight.dtype
    b, s, p = n[BATCH], n[SEQ], n[PAST]
    past = [torch.randn(b, p, c.num_kv_heads, c.head_dim).to(dtype) for _ in range(2 * c.num_layers)]
    args = (torch.randint(0, c.vocab_size, (b, s)), _positions(b, p, s), *past)
    B, S, P = torch.export.Dim(BATCH), torch.export.Dim(SEQ), torch.export.Dim(PAST, min=0)
    shapes = ({0: B, 1: S}, {0: B, 1: S}, tuple({0: B, 1: P} for _ in past))
    return args, shapes


def context_inputs(drafter, block_size: int):
    n = _sizes(block_size)
    dtype = drafter.fc.weight.dtype
    b, ctx = n[BATCH], n[CTX]
    args = (torch.randn(b, ctx, drafter.fc.in_features).to(dtype), _positions(b, 3, ctx))
    B, X = torch.export.Dim(BATCH), torch.export.Dim(CTX)
    return args, ({0: B, 1: X}, {0: B, 1: X})


def block_inputs(drafter, target, block_size: int, mask_token_id: int):
    c, n = drafter.config, _sizes(block_size)
    dtype = drafter.fc.weight.dtype
    b, p = n[BATCH], n[PAST_CTX]
    ids = torch.full((b, block_size), mask_token_id, dtype=torch.long)
    ids[:, 0] = torch.randint(0, target.config.vocab_size, (b,))
    past = [torch.randn(b, p, c.num_kv_heads, c.head_dim).to(dtype) for _ in range(2 * c.num_layers)]
    args = (ids, _positions(b, p, block_size), *past)
    B, P = torch.export.Dim(BATCH), torch.export.Dim(PAST_CTX, min=0)
    return args, ({0: B}, {0: B}, tuple({0: B, 1: P} for _ in past))
