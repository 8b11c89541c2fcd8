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

from ..models.layers import apply_rope, rope_cos_sin


def block_logits(drafter, target, ctx_kv, seq_index: torch.Tensor, block_ids: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits [N, K-1, V] for N blocks, block i over context `ctx_kv[seq_index[i]]` before anchor i."""
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
    n, _, h = hidden.shape
    # 2-D: a [N, K-1, H] slice is not contiguous, and linear on it ran as N batched copies of the head
    return target.lm_head(hidden[:, 1:].reshape(-1, h)).float().view(n, k - 1, -1)


def grouped_block(drafter, x: torch.Tensor, positions: torch.Tensor, ctx_kv, anchors: torch.Tensor, per: int):
    """`Drafter.block` for N = B * per blocks, sequence-major, over per-sequence contexts [B, C, Hkv, D]."""
    n, k, _ = x.shape
    cos, sin = rope_cos_sin(positions, drafter.inv_freq, x.dtype)
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
