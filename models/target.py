"""The target decoder (Llama / Qwen2 / Qwen3 family, Qwen3-MoE) with feature taps.

One forward serves prefill, 1-token steps and K-token verify: it takes the valid prefix
of a sequence-major KV cache (`[B, P, Hkv, D]` per layer, P may be 0; the exported graph's
form) and returns only the new positions' K/V for the runtime to write by index; or it
takes a `KVCache` (models/kvcache.py) and writes them itself, by index, before attending. Module names follow transformers, so a Hugging Face
state dict loads as is.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..runtime.errors import DFlashError
from .checkpoint import load_state_dict, strict_load
from .config import TargetConfig
from .kvcache import KV, KVCache
from .layers import RMSNorm, apply_rope, attend, causal_visible, rope_cos_sin
from .moe import fuse_experts, mlp_for
from . import gemma4, gpt_oss
from .qwen35 import HybridTarget


class Attention(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.h, self.hkv, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.d, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.qk_norm = c.qk_norm

    def qkv(self, x, cos, sin):
        """Queries [B,S,H,D] and this step's keys/values [B,S,Hkv,D] (normed, rotated)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.d)
        k = self.k_proj(x).view(b, s, self.hkv, self.d)
        v = self.v_proj(x).view(b, s, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, kv, visible):
        """kv(k, v) -> all keys/values to attend to (the cache's update, or past + new)."""
        q, k, v = self.qkv(x, cos, sin)
        out = attend(q, *kv(k, v), visible)
        return self.o_proj(out), k, v


class DecoderLayer(nn.Module):
    def __init__(self, c: TargetConfig, i: int):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = mlp_for(c, i)  # dense SwiGLU, or Qwen3-MoE's expert block (models/moe.py)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, kv, visible):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, kv, visible)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Body(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Target(nn.Module):
    def __init__(self, config: TargetConfig, tap_ids: list[int] = ()):
        super().__init__()
        self.config = config
        self.tap_ids = list(tap_ids)
        self.model = Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", config.rope.inv_freq(config.head_dim), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def empty_kv(self, batch: int = 1) -> KV:
        c, w = self.config, self.model.embed_tokens.weight
        z = w.new_zeros(batch, 0, c.num_kv_heads, c.head_dim)
        return [(z, z) for _ in range(c.num_layers)]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: KV | KVCache):
        """-> logits [B,S,V] (fp32), taps [B,S,T*H], new K/V per layer [B,S,Hkv,D]."""
        x, taps, new = self.hidden(input_ids, position_ids, past)
        return self.logits(x), taps, new

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states (after the norm, as `hidden` returns them) -> fp32 logits."""
        return self.lm_head(x).float()

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: KV | KVCache,
               past_lengths: torch.Tensor | None = None, position_major: bool = False):
        """The decoder stack: last hidden state (after the final norm), taps, new K/V.

        `past_lengths` [B]: each row's valid past positions (a ragged batch, layers.causal_visible).
        `position_major`: the past comes [P, B, Hkv, D] (the ragged graphs' cache); the new K/V
        join it on that axis, so the exported graph transposes [past; new] once, as before."""
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, x.dtype, self.config.rope.attention_factor)
        cache = past if isinstance(past, KVCache) else None
        s, p = input_ids.shape[1], cache.length if cache else past[0][0].shape[0 if position_major else 1]
        visible = causal_visible(p, s, past_lengths, x.device)  # new query i sits at index p + i
        outs, new = {}, []
        for i, layer in enumerate(self.model.layers):
            if cache:
                kv = lambda k, v, i=i: cache.update(i, k, v)  # noqa: E731
            elif position_major:
                kv = lambda k, v, i=i: tuple(torch.cat([past[i][e], t.transpose(0, 1)], 0).transpose(0, 1)  # noqa: E731
                                             for e, t in enumerate((k, v)))
            else:
                kv = lambda k, v, i=i: (torch.cat([past[i][0], k], 1), torch.cat([past[i][1], v], 1))  # noqa: E731
            x, k, v = layer(x, cos, sin, kv, visible)
            new.append((k, v))
            outs[i] = x
        return *self.final(outs), new

    def final(self, outs: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each decoder layer's output -> (last hidden state after the final norm, taps).

        Tap i = transformers' hidden_states[i + 1]: the raw output of decoder layer i, except
        the last layer's, which transformers reports after the final norm (the z-lab drafters
        read hidden_states as they are)."""
        last = len(self.model.layers) - 1
        x = outs[last] = self.model.norm(outs[last])
        taps = torch.cat([outs[i] for i in self.tap_ids], dim=-1) if self.tap_ids else x[..., :0]
        return x, taps

    @classmethod
    def from_pretrained(cls, directory: str | Path, tap_ids: list[int] = (), dtype: torch.dtype = torch.float32):
        config = TargetConfig.load(directory)
        bad = [i for i in tap_ids if not 0 <= i < config.num_layers]
        if bad:
            raise DFlashError(f"tap layer ids {bad} are outside the target's {config.num_layers} layers")
        if config.hybrid:  # Qwen3.5 / 3.6: Gated DeltaNet + gated attention

            return HybridTarget.from_pretrained(directory, tap_ids, dtype)
        if config.windowed:  # gpt-oss / Gemma 4: sliding and full attention layers (models/windowed.py)
            family = {"gpt_oss": gpt_oss, "gemma4": gemma4}[config.windowed.family]
            return family.from_pretrained(config, directory, tap_ids, dtype)
        with torch.device("meta"):
            model = cls(config, tap_ids)
        state = fuse_experts(load_state_dict(directory, "target"), config, f"target {directory}")
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        strict_load(model, state, f"target {directory}", dtype, tied={"lm_head.weight"} if config.tie_word_embeddings else set())
        model.inv_freq = config.rope.inv_freq(config.head_dim)
        return model.eval()
