"""The ORT attention flavour's one non-standard op: com.microsoft GroupQueryAttention.

`gqa` is a torch custom op that torch.onnx.export turns into one GroupQueryAttention node
(`TRANSLATION`). Its eager implementation is the reference the `check` compares ONNX
Runtime against: the new K/V written into a copy of the head-major cache at
[total - seq, total), then the model's own `attend` over [0, total), causal. ONNX Runtime
writes the same rows in place when past and present are bound to one buffer (runtime/ort.py).
"""

from __future__ import annotations

import torch
from onnxscript import values

from ..models.layers import attend
from .validate import register_gqa_schema


@torch.library.custom_op("dflash::gqa", mutates_args=())
def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
        seqlens_k: torch.Tensor, total: torch.Tensor, num_heads: int, kv_heads: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1,S,H*D], k/v [1,S,Hkv*D], past [1,Hkv,max,D] -> out [1,S,H*D], present [1,Hkv,max,D]."""
    b, s, _ = q.shape
    d, end = past_k.shape[-1], int(total)
    start = end - s
    pk, pv = past_k.clone(), past_v.clone()
    pk[:, :, start:end] = k.view(b, s, kv_heads, d).transpose(1, 2)
    pv[:, :, start:end] = v.view(b, s, kv_heads, d).transpose(1, 2)
    visible = torch.arange(end)[None, :] <= (start + torch.arange(s))[:, None]
    out = attend(q.view(b, s, num_heads, d), pk[:, :, :end].transpose(1, 2), pv[:, :, :end].transpose(1, 2), visible)
    return out, pk, pv


@gqa.register_fake
def _(q, k, v, past_k, past_v, seqlens_k, total, num_heads, kv_heads):
    return q.new_empty(q.shape), past_k.new_empty(past_k.shape), past_v.new_empty(past_v.shape)


register_gqa_schema()
_msft = values.Opset("com.microsoft", 1)


def _gqa_onnx(q, k, v, past_k, past_v, seqlens_k, total, num_heads: int, kv_heads: int):
    return _msft.GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total, num_heads=num_heads, kv_num_heads=kv_heads)


TRANSLATION = {torch.ops.dflash.gqa.default: _gqa_onnx}
