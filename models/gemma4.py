"""The Gemma 4 text decoder layer (transformers' `Gemma4ForCausalLM`, and the text part of
`Gemma4ForConditionalGeneration` checkpoints).

Per layer: attention (models/windowed.py) between input_layernorm and post_attention_layernorm,
a GeGLU MLP (gelu-tanh) between pre_ and post_feedforward_layernorm, each added to the
residual; then, where configured, the per-layer input: gelu(gate(x)) * this layer's slice of the
per-layer embeddings, projected back, normed and added; finally the whole times `layer_scalar`.

Gemma 4 26B-A4B (`enable_moe_block`) adds a mixture of GeGLU experts beside the dense MLP in
every layer: routed from the residual (Router), run on its own pre-norm, summed with the MLP's
output after a post-norm each; the k weights (softmax, top-k, renormalise) times the router's
`per_expert_scale`, which export folds into the down projections (Layer.fold).

Per-layer embeddings (`hidden_size_per_layer_input` > 0), computed once per call from the ids
and the scaled embedding: (norm(proj(embedding) / sqrt(hidden)) + table(ids) * sqrt(width)) / sqrt(2),
reshaped to one slice per layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from .checkpoint import load_state_dict
from .config import TargetConfig
from .moe import Experts, route
from .windowed import Norm, WindowAttention, WindowedTarget, drop_unused


def _act(name: str):
    return (lambda x: F.gelu(x, approximate="tanh")) if name == "gelu_pytorch_tanh" else F.silu


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Gemma 4's router: RMSNorm without scale, times a learned scale and H^-0.5, then the logits.
    Its `per_expert_scale` multiplies each selected expert's weight (Layer.route)."""

    def __init__(self, c: TargetConfig):
        super().__init__()
        h = c.hidden_size
        self.norm = Norm(h, c.rms_norm_eps, scale=False)
        self.proj = nn.Linear(h, c.moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(c.moe.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x) * self.scale * x.shape[-1] ** -0.5)


class Layer(nn.Module):
    """A decoder layer; with `enable_moe_block` also the MoE block of models/moe.py's protocol
    (`experts`, `top_k`, `norm_topk_prob`, `graph_experts`, `fold`), beside the dense MLP."""

    def __init__(self, c: TargetConfig, i: int):
        super().__init__()
        w, h, eps = c.windowed, c.hidden_size, c.rms_norm_eps
        shared = w.kv_source[i] != i
        self.self_attn = WindowAttention(c, c.layer_types[i], shared)
        self.mlp = MLP(h, c.intermediate_size * (2 if w.double_wide_mlp and shared else 1), w.hidden_act)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Norm(h, eps))
        self.register_buffer("layer_scalar", torch.ones(1))  # in the checkpoint
        if w.per_layer_input:
            self.act = _act(w.hidden_act)
            self.per_layer_input_gate = nn.Linear(h, w.per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(w.per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = Norm(h, eps)
        if c.moe is not None:
            self.router = Router(c)
            self.experts = Experts(c.moe.num_experts, h, c.moe.expert_size, c.moe)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, name, Norm(h, eps))
            self.top_k, self.norm_topk_prob, self.graph_experts = c.moe.top_k, True, None

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' output for the residual x [B, S, H]: routed from x, run on its own norm."""
        t = x.reshape(-1, x.shape[-1])
        logits = self.router(t)
        t = self.pre_feedforward_layernorm_2(t)
        if self.graph_experts is not None:  # export/moe.py (per_expert_scale folded into down_proj)
            return self.graph_experts(self, t, logits).reshape(x.shape)
        weights, ids = route(logits, self.top_k, True)
        weights = weights * self.router.per_expert_scale[ids].to(weights.dtype)
        return self.experts(t, ids, weights).reshape(x.shape)

    def fold(self) -> None:
        """per_expert_scale into each expert's down projection (no biases: exact up to rounding), then 1."""
        s = self.router.per_expert_scale.data
        self.experts.down_proj.data = self.experts.down_proj.data * s[:, None, None].to(self.experts.down_proj.dtype)
        self.router.per_expert_scale.data = torch.ones_like(s)

    def forward(self, x, attention, extra=None):
        x = x + self.post_attention_layernorm(attention(self.input_layernorm(x)))
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if hasattr(self, "experts"):  # 26B-A4B: the dense MLP and the experts, each normed, then summed
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(self.moe(x))
        x = x + self.post_feedforward_layernorm(y)
        if extra is not None:
            y = self.act(self.per_layer_input_gate(x)) * extra
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(y))
        return x * self.layer_scalar.to(x.dtype)


class Body(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        w, h = c.windowed, c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, h)
        self.layers = nn.ModuleList(Layer(c, i) for i in range(c.num_layers))
        self.norm = Norm(h, c.rms_norm_eps)
        if w.per_layer_input:
            self.embed_tokens_per_layer = nn.Embedding(w.per_layer_vocab, c.num_layers * w.per_layer_input)
            self.per_layer_model_projection = nn.Linear(h, c.num_layers * w.per_layer_input, bias=False)
            self.per_layer_projection_norm = Norm(w.per_layer_input, c.rms_norm_eps)


class Gemma4Target(WindowedTarget):
    def __init__(self, config: TargetConfig, tap_ids: list[int] = ()):
        super().__init__(config, tap_ids, Body(config))

    def layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[B,S,L,width]: each layer's slice of the per-layer embeddings (x: the scaled embedding)."""
        c = self.config
        width = c.windowed.per_layer_input
        if not width:
            return None
        m, shape = self.model, (*input_ids.shape, c.num_layers, width)
        table = m.embed_tokens_per_layer(input_ids) * torch.tensor(width**0.5, dtype=x.dtype)
        proj = m.per_layer_model_projection(x) * c.hidden_size**-0.5
        return (m.per_layer_projection_norm(proj.reshape(shape)) + table.reshape(shape)) * 2**-0.5


def from_pretrained(config: TargetConfig, directory: str | Path, tap_ids, dtype: torch.dtype) -> Gemma4Target:
    with torch.device("meta"):
        model = Gemma4Target(config, tap_ids)
    state = load_state_dict(directory, "target")
    if any(k.startswith("model.language_model.") for k in state):  # Gemma4ForConditionalGeneration: its text part
        state = drop_unused(state, ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                                    "model.embed_audio."), directory, "the vision and audio towers")
        state = {k.replace("model.language_model.", "model.", 1): v for k, v in state.items()}
    shared = tuple(f"model.layers.{i}.self_attn.{n}." for i in config.windowed.shared_layers
                   for n in ("k_proj", "v_proj", "k_norm", "v_norm"))
    state = drop_unused(state, shared, directory, "K/V weights of KV-sharing layers, which read an earlier layer's")
    return model.load(state, directory, dtype)
