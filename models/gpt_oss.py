"""The gpt-oss decoder layer (transformers' `GptOssForCausalLM`): sinks attention + a mixture of experts.

Attention is models/windowed.py's (biases, YaRN, sinks, sliding / full per layer). The MLP
routes each token to `top_k` of `experts` experts: top-k on the biased router logits, then a
softmax over those k (the same weights as softmax, top-k, renormalise). An expert is a
clamped SwiGLU with biases, its gate and up columns interleaved in `gate_up_proj` [E, H, 2I]:
g = min(gate, limit), u = clamp(up, -limit, limit), out = ((u + 1) * g * sigmoid(alpha g)) @ down.

The reference runs every expert on every token and weights the unselected ones by 0: exact,
in standard ops, and affordable at test sizes; real sizes need the routed expert path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from .checkpoint import load_state_dict, strict_load
from .config import TargetConfig
from .windowed import Norm, WindowAttention, WindowedTarget


class Router(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        w = c.windowed
        self.weight = nn.Parameter(torch.zeros(w.experts, c.hidden_size))
        self.bias = nn.Parameter(torch.zeros(w.experts))
        self.top_k = w.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> routing weights [N, E]: softmax over the top-k logits, 0 elsewhere."""
        top, idx = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return torch.zeros(x.shape[0], self.weight.shape[0], dtype=x.dtype).scatter(1, idx, torch.softmax(top, -1))


class Experts(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        w, h, i = c.windowed, c.hidden_size, c.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(w.experts, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(w.experts, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(w.experts, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(w.experts, h))
        self.alpha, self.limit = w.swiglu_alpha, w.swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, E] -> sum_e weights[:, e] * expert_e(x)."""
        gu = torch.einsum("nh,ehf->enf", x, self.gate_up_proj) + self.gate_up_proj_bias[:, None]
        gate, up = gu[..., ::2].clamp(max=self.limit), gu[..., 1::2].clamp(-self.limit, self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = torch.einsum("enf,efh->enh", act, self.down_proj) + self.down_proj_bias[:, None]
        return (out * weights.t()[..., None]).sum(0)


class MoE(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.router = Router(c)
        self.experts = Experts(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        return self.experts(flat, self.router(flat)).reshape(b, s, h)


class Layer(nn.Module):
    def __init__(self, c: TargetConfig, i: int):
        super().__init__()
        self.self_attn = WindowAttention(c, c.layer_types[i], shared=False)
        self.mlp = MoE(c)
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
        super().__init__(config, tap_ids)
        self.model = Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def from_pretrained(config: TargetConfig, directory: str | Path, tap_ids, dtype: torch.dtype) -> GptOssTarget:
    with torch.device("meta"):
        model = GptOssTarget(config, tap_ids)
    state = load_state_dict(directory, "target")
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for name in tied:
        state.pop(name, None)
    strict_load(model, state, f"target {directory}", dtype, tied=tied)
    model.set_frequencies()
    return model.eval()
