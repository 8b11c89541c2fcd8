"""The drafter's training forward: many blocks per sequence, each over its own context prefix.

The math is `Drafter.block` (the inference and export path) with a per-block context mask
(`Drafter.block_mask`, one rule for both). When every sequence has the same number of blocks,
side by side (as `sample_anchors` makes them), attention is split in two: scores against the
sequence's context are one large matmul per sequence, scores within each block one small matmul
per block, and one softmax runs over both. That avoids copying the context's K/V once per block
(and summing those copies in the backward pass), which cost about half of a step.
tests/test_train.py checks both paths against inference block by block.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..models.layers import apply_rope, rope_cos_sin
from .data import Shard
from .loss import head_loss


def block_logits(drafter, target, ctx_kv, seq_index: torch.Tensor, block_ids: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits [N, K-1, V] for N blocks, block i over context `ctx_kv[seq_index[i]]` before anchor i."""
    hidden = block_hidden(drafter, target, ctx_kv, seq_index, block_ids, anchors)
    n, k1, h = hidden.shape
    # 2-D: a [N, K-1, H] slice is not contiguous, and linear on it ran as N batched copies of the head
    return target.lm_head(hidden.reshape(-1, h)).float().view(n, k1, -1)


def block_hidden(drafter, target, ctx_kv, seq_index: torch.Tensor, block_ids: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's final hidden states [N, K-1, H] at the predicted positions (`block_logits` before the head)."""
    k = block_ids.shape[1]
    positions = anchors[:, None] + torch.arange(k)[None]
    emb = target.embed(block_ids)
    rows, counts = torch.unique_consecutive(seq_index, return_counts=True)
    if bool((counts == counts[0]).all()) and len(rows) == len(set(rows.tolist())):
        if not torch.equal(rows, torch.arange(ctx_kv[0][0].shape[0])):
            ctx_kv = [(kc[rows], vc[rows]) for kc, vc in ctx_kv]
        hidden = grouped_block(drafter, emb, positions, ctx_kv, anchors, int(counts[0]))
    else:
        ctx = [(kc[seq_index], vc[seq_index]) for kc, vc in ctx_kv]
        hidden = drafter.block(emb, positions, ctx, anchors)
    return hidden[:, 1:]


def grouped_block(drafter, x: torch.Tensor, positions: torch.Tensor, ctx_kv, anchors: torch.Tensor, per: int):
    """`Drafter.block` for N = B * per blocks, sequence-major, over per-sequence contexts [B, C, Hkv, D]."""
    n, k, _ = x.shape
    cos, sin = rope_cos_sin(positions, drafter.inv_freq, x.dtype, drafter.config.rope.attention_factor)
    c = ctx_kv[0][0].shape[1]
    for j, layer in enumerate(drafter.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(a.q_norm(a.q_proj(h).view(n, k, a.h, a.d)), cos, sin)
        kb, vb = a.kv(h, cos, sin)
        mask = drafter.block_mask(j, c, k, anchors, x.device)  # [N, 1 or K, C+K]
        kc, vc = ctx_kv[j][0].to(kb.dtype), ctx_kv[j][1].to(vb.dtype)  # .to: autocast training
        x = x + a.o_proj(grouped_attend(q, kc, vc, kb, vb, mask, per))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def grouped_attend(q, kc, vc, kb, vb, mask: torch.Tensor, per: int) -> torch.Tensor:
    """q [N,K,H,D]; context kc/vc [B,C,Hkv,D]; block kb/vb [N,K,Hkv,D]; mask [N,1|K,C+K] -> [N,K,H*D].

    `layers.attend` over keys [context ; block], with GQA's g query heads of one KV head stacked
    along the rows in the same (g, K) order.
    """
    n, k, h, d = q.shape
    b, c, hkv, _ = kc.shape
    g = h // hkv
    q = q * (d**-0.5)  # scaled here, on the smaller tensor
    qq = q.reshape(b, per, k, hkv, g, d).permute(0, 3, 1, 4, 2, 5).reshape(b, hkv, per, g * k, d)
    s_ctx = torch.matmul(qq.reshape(b, hkv, per * g * k, d), kc.permute(0, 2, 3, 1)).view(b, hkv, per, g * k, c)
    s_blk = torch.matmul(qq, kb.reshape(b, per, k, hkv, d).permute(0, 3, 1, 4, 2))  # [B, Hkv, per, gK, K]
    scores = torch.cat([s_ctx, s_blk], -1)
    m = mask.view(b, 1, per, mask.shape[1], c + k)
    if m.shape[3] > 1:
        m = m.repeat(1, 1, 1, g, 1)  # rows ordered (g, K), like qq
    scores = scores.masked_fill(~m, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :c].reshape(b, hkv, per * g * k, c), vc.transpose(1, 2)).view(b, hkv, per, g * k, d)
    out = out + torch.matmul(probs[..., c:], vb.reshape(b, per, k, hkv, d).permute(0, 3, 1, 2, 4))
    return out.view(b, hkv, per, g, k, d).permute(0, 2, 4, 1, 3, 5).reshape(n, k, h * d)


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
               autocast: bool = False, taps: torch.Tensor | None = None, correct: bool = True):
    """-> (weighted loss, correct [N,K-1] bool (None unless `correct`), valid [N,K-1] bool) for blocks at `anchors`.

    `taps`: the target's features of `tokens` when cached (train.cache.FeatureCache); else
    the target runs here. `autocast`: bf16 autocast (faster only on CPUs with native bf16).
    """
    b, t = tokens.shape
    pos = torch.arange(t)[None].expand(b, t)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if taps is None:
            with torch.no_grad():
                _, taps, _ = target(tokens, pos, target.empty_kv(b))  # once per sequence
        ctx_kv = drafter.context_kv(taps if autocast else taps.float(), pos)  # once per sequence, shared by its blocks
        block, labels, valid = block_batch(tokens, length, seq_index, anchors, block_size, mask_token_id)
        hidden = block_hidden(drafter, target, ctx_kv, seq_index, block, anchors)
    w = weights[None, :] * valid
    if not correct:  # training: the fused head + loss (train/loss.py), no logits kept
        loss = head_loss(hidden.reshape(-1, hidden.shape[-1]), target.lm_head.weight, labels.reshape(-1),
                         w.reshape(-1), autocast)
        return loss / w.sum().clamp(min=1e-6), None, valid
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = target.lm_head(hidden.reshape(-1, hidden.shape[-1])).float().view(*labels.shape, -1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    return loss, logits.detach().argmax(-1) == labels, valid
