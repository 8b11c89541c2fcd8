"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU, attention.

Written with plain matmul/softmax (no fused SDPA) so the ONNX export is standard ai.onnx
ops that every ORT provider and TensorRT's parser take, and so numerics match transformers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        # x / sqrt (not x * rsqrt): ONNX Runtime fuses this form into one SimplifiedLayerNormalization
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos/sin [B, S, D] for positions [B, S], computed in fp32 as transformers does; `scale`:
    YaRN's attention factor, which transformers multiplies into both (Rope.attention_factor)."""
    freqs = position_ids.float()[..., None] * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] (sequence-major, as the KV cache), cos/sin [B, S, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def causal_visible(p: int, s: int, past_lengths: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Which of the P + S keys ([past; new]) each of the S new queries sees: causal, [S, P+S];
    or per row [B, S, P+S] given `past_lengths` [B]: a row's past slots from its own length
    up to P are padding (a ragged batch), masked like the future."""
    t = torch.arange(p + s, device=device)
    visible = t[None, :] <= (p + torch.arange(s, device=device))[:, None]
    if past_lengths is None:
        return visible
    valid = (t[None, :] < past_lengths[:, None]) | (t[None, :] >= p)  # B T
    return visible[None] & valid[:, None, :]


def position_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query sees, from positions: [B, S, T] for query positions [B, S] and key
    positions [B, T] (< 0: an empty slot). Causal, and within `window` positions (the query's
    own included, transformers' sliding window) when given. Slots of any order: a ring cache's."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    visible = (k >= 0) & (k <= q)
    return visible & (q - k < window) if window is not None else visible


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
           scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B,S,H,D], k/v [B,T,Hkv,D] (GQA) -> [B,S,H*D].

    visible: None, one mask [S,T] for the whole batch (inference, export), or one per batch
    row [B,S,T] / [B,1,T] (training: many blocks, each over its own context prefix).
    scale: the scores' factor (None: D^-0.5). sinks [H]: gpt-oss's learned per-head logit,
    one more column of the softmax whose probability is dropped (the weights sum below 1).
    """
    b, s, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    # GQA without repeating K/V: the g query heads of one KV head are stacked along the rows,
    # so the exported graph never materialises g copies of the cache (per layer, per step)
    q = q.reshape(b, s, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * s, d)  # B Hkv (g S) D
    k = k.transpose(1, 2)  # B Hkv T D
    v = v.transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)) * (d**-0.5 if scale is None else scale)
    if visible is not None:
        if visible.dim() == 2:
            m = visible.repeat(g, 1)  # rows ordered (g, s), like q
        else:
            m = visible[:, None]
            m = m.repeat(1, 1, g, 1) if m.shape[2] > 1 else m
        scores = scores.masked_fill(~m, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:  # rows ordered (g, s) per KV head, like q: head kv * g + j sits in rows j * s .. j * s + s - 1
        sink = sinks.reshape(hkv, g, 1).expand(hkv, g, s).reshape(1, hkv, g * s, 1).expand(b, -1, -1, -1)
        probs = torch.softmax(torch.cat([scores, sink.to(scores.dtype)], -1).float(), dim=-1)[..., :-1].to(q.dtype)
    out = torch.matmul(probs, v)  # B Hkv (g S) D
    return out.reshape(b, hkv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h * d)
