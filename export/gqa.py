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
- with `k_scale` / `v_scale` (float32 [Hkv, 1, D], one scale per cache channel) the cache is
  int8, as ONNX Runtime's quantized cache (k_quant_type PER_CHANNEL, kv_cache_bit_width 8):
  the new K (after rotary) and V are stored as clamp(round_half_even(x * (1 / scale)), -128, 127)
  and attention reads the whole cache dequantized (stored value * scale), the new rows
  included. Checked against ONNX Runtime 1.32 by tests/test_kv_int8.py (rounding, clamp,
  layout, output).
- `skip_rms`: (rms_norm(x + y) * weight, x + y), the second output being the residual stream.
Fewer, larger nodes matter on CPU: ONNX Runtime's cost per node dominates a small model's step.
"""

from __future__ import annotations

import contextlib

import torch
from onnxscript import values

from ..models.layers import apply_rope, attend
from .ops import register_ort_schemas


@torch.library.custom_op("dflash::gqa", mutates_args=())
def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
        seqlens_k: torch.Tensor, total: torch.Tensor, cos_cache: torch.Tensor | None, sin_cache: torch.Tensor | None,
        num_heads: int, kv_heads: int, query_seqlens: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B,S,H*D], k/v [B,S,Hkv*D], past [B,Hkv,max,D], cos/sin [max,D/2] or None (q/k
    already rotated), query_seqlens [B] or None (every row at [total - S, total)), k/v_scale
    [Hkv,1,D] or None (an int8 cache, or one in q's dtype) -> out [B,S,H*D], present [B,Hkv,max,D]."""
    if query_seqlens is not None:
        return _gqa_rows(q, k, v, past_k, past_v, seqlens_k, cos_cache, sin_cache, num_heads, kv_heads, query_seqlens,
                         k_scale, v_scale)
    b, s, _ = q.shape
    d, end = past_k.shape[-1], int(total)
    start = end - s
    q, k = q.view(b, s, num_heads, d), k.view(b, s, kv_heads, d)
    if cos_cache is not None:
        cos, sin = (torch.cat([c[start:end], c[start:end]], -1)[None] for c in (cos_cache, sin_cache))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pk, pv = past_k.clone(), past_v.clone()
    pk[:, :, start:end] = quantize(k.transpose(1, 2), k_scale)
    pv[:, :, start:end] = quantize(v.view(b, s, kv_heads, d).transpose(1, 2), v_scale)
    visible = torch.arange(end)[None, :] <= (start + torch.arange(s))[:, None]
    keys, values = (dequantize(c[:, :, :end], sc, q.dtype).transpose(1, 2) for c, sc in ((pk, k_scale), (pv, v_scale)))
    out = attend(q, keys, values, visible)
    return out, pk, pv


_stored: list | None = None  # `stored_as`: what ONNX Runtime stored, one tensor per quantize call
STORED_STATS = {"values": 0, "one_step_apart": 0}  # over every `stored_as` (check reports them)


def quantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [B,Hkv,S,D] as the cache stores it: itself, or int8 clamp(round(x * (1 / scale))): ONNX
    Runtime multiplies by the fp32 reciprocal (not a division: they differ at halves) and rounds
    half to even, as torch.round does."""
    if scale is None:
        return x
    q = torch.clamp(torch.round(x.float() * (1 / scale)), -128, 127).to(torch.int8)
    if _stored is not None:  # a value within float error of a rounding boundary: take ORT's side of it
        theirs = _stored.pop(0)
        step = (q.int() - theirs.int()).abs()
        STORED_STATS["values"] += q.numel()
        STORED_STATS["one_step_apart"] += int((step == 1).sum())
        q = torch.where(step <= 1, theirs, q)
    return q


@contextlib.contextmanager
def stored_as(values: list[torch.Tensor]):
    """Within: each int8 store takes ONNX Runtime's value (`values`, one per `quantize` call, in
    call order: layer, row, K then V) where it is within one step of its own. Inputs that differ
    by float rounding land on either side of a .5 about once in a few hundred values, and one
    step of one cache value moves the outputs by ~1e-2; `check` compares the graph's outputs
    given the same cache contents, and the contents themselves within one step."""
    global _stored
    _stored = list(values)
    try:
        yield
    finally:
        _stored = None


def dequantize(c: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return c if scale is None else (c.float() * scale).to(dtype)


def _gqa_rows(q, k, v, past_k, past_v, seqlens_k, cos_cache, sin_cache, num_heads: int, kv_heads: int, counts,
              k_scale=None, v_scale=None):
    """`gqa` row by row, each row's first counts[r] tokens at [seqlens_k[r] + 1 - counts[r], seqlens_k[r] + 1)."""
    pk, pv = past_k.clone(), past_v.clone()
    out = q.new_zeros(q.shape)
    for r in range(q.shape[0]):
        c, end = int(counts[r]), int(seqlens_k[r]) + 1
        if c == 0:  # an idle row: its cache unchanged
            continue
        o, k_r, v_r = gqa(q[r : r + 1, :c], k[r : r + 1, :c], v[r : r + 1, :c], pk[r : r + 1], pv[r : r + 1],
                          seqlens_k[r : r + 1], torch.tensor(end), cos_cache, sin_cache, num_heads, kv_heads, None,
                          k_scale, v_scale)
        out[r : r + 1, :c], pk[r : r + 1], pv[r : r + 1] = o, k_r, v_r
    return out, pk, pv


@gqa.register_fake
def _(q, k, v, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, num_heads, kv_heads, query_seqlens=None,
      k_scale=None, v_scale=None):
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
              query_seqlens=None, k_scale=None, v_scale=None):
    # inputs 7..16: cos_cache, sin_cache, position_ids, attention_bias, head_sink, k_scale, v_scale,
    # q_norm_weight, k_norm_weight, query_seqlens; trailing unset ones are left out
    rest = [cos_cache, sin_cache, None, None, None, k_scale, v_scale, None, None, query_seqlens]
    while rest and rest[-1] is None:
        rest.pop()
    attrs = dict(num_heads=num_heads, kv_num_heads=kv_heads)
    if cos_cache is not None:
        attrs["do_rotary"] = 1
    if k_scale is not None:
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    return _msft.GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total, *rest, **attrs)


def _skip_rms_onnx(x, y, weight, eps: float):
    out, _, _, s = _msft.SkipSimplifiedLayerNormalization(x, y, weight, epsilon=eps)
    return out, s


TRANSLATION = {torch.ops.dflash.gqa.default: _gqa_onnx, torch.ops.dflash.skip_rms.default: _skip_rms_onnx}
