"""The ORT attention flavour's non-standard ops: com.microsoft GroupQueryAttention (with the
rotary embedding inside) and SkipSimplifiedLayerNormalization (residual add + RMSNorm).

Each is a torch custom op that torch.onnx.export turns into one node (`TRANSLATION`). The
eager implementations are the references `check` compares ONNX Runtime against, written
with the model's own functions (`attend`, `apply_rope`, RMSNorm's arithmetic):
- `gqa`: q/k rotated at their absolute positions [total - seq, total) by rows of the
  cos/sin caches (when given), the new K/V written into a copy of the head-major cache at
  those rows, then `attend` over [0, total), causal. ONNX Runtime writes the same rows in
  place when past and present are bound to one buffer (runtime/ort/backend.py). With
  `query_seqlens` (each row's count c of new tokens, the rest of its seq right padding) a row
  holds seqlens_k + 1 positions after the call and its tokens sit at [seqlens_k + 1 - c,
  seqlens_k + 1): rows of different lengths verify in one call (ONNX Runtime >= 1.32; without
  it GroupQueryAttention refuses several new tokens with a past at batch > 1). Padding
  positions write nothing; their outputs are zeros here and unspecified in ONNX Runtime.
- `skip_rms`: (rms_norm(x + y) * weight, x + y), the second output being the residual stream.
Fewer, larger nodes matter on CPU: ONNX Runtime's cost per node dominates a small model's step.
"""

from __future__ import annotations

import torch
from onnxscript import values

from ..models.layers import apply_rope, attend
from .ops import register_ort_schemas


@torch.library.custom_op("dflash::gqa", mutates_args=())
def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
        seqlens_k: torch.Tensor, total: torch.Tensor, cos_cache: torch.Tensor | None, sin_cache: torch.Tensor | None,
        num_heads: int, kv_heads: int, query_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B,S,H*D], k/v [B,S,Hkv*D], past [B,Hkv,max,D], cos/sin [max,D/2] or None (q/k
    already rotated), query_seqlens [B] or None (every row at [total - S, total)) -> out
    [B,S,H*D], present [B,Hkv,max,D]."""
    if query_seqlens is not None:
        return _gqa_rows(q, k, v, past_k, past_v, seqlens_k, cos_cache, sin_cache, num_heads, kv_heads, query_seqlens)
    b, s, _ = q.shape
    d, end = past_k.shape[-1], int(total)
    start = end - s
    q, k = q.view(b, s, num_heads, d), k.view(b, s, kv_heads, d)
    if cos_cache is not None:
        cos, sin = (torch.cat([c[start:end], c[start:end]], -1)[None] for c in (cos_cache, sin_cache))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pk, pv = past_k.clone(), past_v.clone()
    pk[:, :, start:end] = k.transpose(1, 2)
    pv[:, :, start:end] = v.view(b, s, kv_heads, d).transpose(1, 2)
    visible = torch.arange(end)[None, :] <= (start + torch.arange(s))[:, None]
    out = attend(q, pk[:, :, :end].transpose(1, 2), pv[:, :, :end].transpose(1, 2), visible)
    return out, pk, pv


def _gqa_rows(q, k, v, past_k, past_v, seqlens_k, cos_cache, sin_cache, num_heads: int, kv_heads: int, counts):
    """`gqa` row by row, each row's first counts[r] tokens at [seqlens_k[r] + 1 - counts[r], seqlens_k[r] + 1)."""
    pk, pv = past_k.clone(), past_v.clone()
    out = q.new_zeros(q.shape)
    for r in range(q.shape[0]):
        c, end = int(counts[r]), int(seqlens_k[r]) + 1
        if c == 0:  # an idle row: its cache unchanged
            continue
        o, k_r, v_r = gqa(q[r : r + 1, :c], k[r : r + 1, :c], v[r : r + 1, :c], pk[r : r + 1], pv[r : r + 1],
                          seqlens_k[r : r + 1], torch.tensor(end), cos_cache, sin_cache, num_heads, kv_heads)
        out[r : r + 1, :c], pk[r : r + 1], pv[r : r + 1] = o, k_r, v_r
    return out, pk, pv


@gqa.register_fake
def _(q, k, v, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, num_heads, kv_heads, query_seqlens=None):
    return q.new_empty(q.shape), past_k.new_empty(past_k.shape), past_v.new_empty(past_v.shape)


@torch.library.custom_op("dflash::skip_rms", mutates_args=())
def skip_rms(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + y -> (RMSNorm(x + y), x + y), with models.layers.RMSNorm's arithmetic."""
    s = x + y
    h = s.float()
    h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


@skip_rms.register_fake
def _(x, y, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


register_ort_schemas()
_msft = values.Opset("com.microsoft", 1)


def _gqa_onnx(q, k, v, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, num_heads: int, kv_heads: int,
              query_seqlens=None):
    rows = () if query_seqlens is None else (None,) * 7 + (query_seqlens,)  # position_ids .. k_norm_weight unset
    if cos_cache is None:
        return _msft.GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total, *((None, None, *rows) if rows else ()),
                                         num_heads=num_heads, kv_num_heads=kv_heads)
    return _msft.GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, *rows,
                                     num_heads=num_heads, kv_num_heads=kv_heads, do_rotary=1)


def _skip_rms_onnx(x, y, weight, eps: float):
    out, _, _, s = _msft.SkipSimplifiedLayerNormalization(x, y, weight, epsilon=eps)
    return out, s


TRANSLATION = {torch.ops.dflash.gqa.default: _gqa_onnx, torch.ops.dflash.skip_rms.default: _skip_rms_onnx}
