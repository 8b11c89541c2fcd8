"""The gpt-oss decoder layer (transformers' `GptOssForCausalLM`): sinks attention + a mixture of experts.

Attention is models/windowed.py's (biases, YaRN, sinks, sliding / full per layer). The MLP
routes each token to `top_k` of its experts: top-k on the biased router logits, then a
softmax over those k (the same weights as softmax, top-k, renormalise). An expert is a
clamped SwiGLU with biases, its gate and up columns interleaved in `gate_up_proj` [E, H, 2I]:
g = min(gate, limit), u = clamp(up, -limit, limit), out = ((u + 1) * g * sigmoid(alpha g)) @ down.

The MLP is models/moe.py's SparseMoe (router and experts biased, the clamped activation): its
reference runs only the selected experts, and export/moe.py gives it either graph form
(ONNX Runtime's MoE op with activation_alpha 1.702, activation_beta 1, swiglu_limit 7,
swiglu_fusion 1; or standard ops). Loading renames the router and transposes the experts to
[E, 2I, H] / [E, H, I]; released MXFP4 experts are dequantised (models/mxfp4.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_state_dict
from .config import TargetConfig
from .moe import SparseMoe, blocks
from .mxfp4 import dequantize_experts
from .windowed import Norm, WindowAttention, WindowedTarget


class Layer(nn.Module):
    def __init__(self, c: TargetConfig, i: int):
        super().__init__()
        self.self_attn = WindowAttention(c, c.layer_types[i], shared=False)
        self.mlp = SparseMoe(c.hidden_size, c.moe)
        self.input_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Norm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, attention, extra=None):
        x = x + attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c, i) for i in range(c.num_layers))
        self.norm = Norm(c.hidden_size, c.rms_norm_eps)


class GptOssTarget(WindowedTarget):
    def __init__(self, config: TargetConfig, tap_ids: list[int] = ()):
        super().__init__(config, tap_ids, Body(config))


def from_pretrained(config: TargetConfig, directory: str | Path, tap_ids, dtype: torch.dtype) -> GptOssTarget:
    with torch.device("meta"):
        model = GptOssTarget(config, tap_ids)
    state = experts_as_moe(dequantize_experts(load_state_dict(directory, "target"), f"target {directory}"))
    for block in blocks(model):
        block.experts.interleaved = True  # gpt-oss's gate and up columns alternate
    return model.load(state, directory, dtype)


def experts_as_moe(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' gpt-oss names and layout -> models/moe.py's: the router is `gate`, and the
    experts' [E, H, 2I] / [E, I, H] are transposed to [E, 2I, H] / [E, H, I] (gate and up rows
    still interleaved: ONNX Runtime's MoE op reads them so, swiglu_fusion=1)."""
    out = {}
    for name, t in state.items():
        if ".mlp.router." in name:
            name = name.replace(".mlp.router.", ".mlp.gate.")
        elif name.endswith(".mxfp4"):  # dequantised MXFP4 (models/mxfp4.py): already [E, rows, cols]
            name = name[: -len(".mxfp4")]
        elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            t = t.transpose(1, 2).contiguous()
        out[name] = t
    return out
