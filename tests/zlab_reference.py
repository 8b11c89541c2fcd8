"""A reference formulation of greedy DFlash decoding, written from the official z-lab
algorithm (github.com/z-lab/dflash, `dflash/model.py`: `dflash_generate` and
`DFlashDraftModel`), independent of this project's models/ and runtime/.

- The target is transformers' own model; the drafter's features are its
  `output_hidden_states` taken as they are: `hidden_states[i + 1]` for tap id i (the last
  entry is after the final norm in transformers).
- The drafter is transformers' Qwen3 building blocks (RMSNorm, MLP, rotary embedding from
  the drafter's config) over the z-lab weights: queries from the block, keys/values from
  `[k_proj(context); k_proj(block)]` with k_norm and RoPE at true positions, non-causal
  full layers, causal + windowed sliding layers (the official `_attention_mask`).
- The loop is the official full-block one: every round drafts [anchor, MASK x (K-1)] and
  verifies all K positions, the acceptance length is the matching prefix + 1 (never cut),
  the loop runs `while start < max_length`, and the tokens are cut to the budget at the end.

Greedy, no stop tokens. The drafter's context is recomputed from all accepted features each
round instead of cached: the cached K/V of a position never depend on later positions, so
this is the same computation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


class _Attention(nn.Module):
    def __init__(self, cfg, layer: int, layer_types: list[str]):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        h, kv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * self.d, bias=False)
        self.o_proj = nn.Linear(h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.d, eps=cfg.rms_norm_eps)
        sliding = layer_types[layer] == "sliding_attention"
        explicit = getattr(cfg, "is_causal", None)
        self.causal = sliding if explicit is None else bool(explicit)
        self.window = cfg.sliding_window if sliding else None
        self.groups = h // kv

    def forward(self, x, ctx, cos, sin):
        from transformers.models.qwen3.modeling_qwen3 import rotate_half

        b, q_len, _ = x.shape
        c = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, self.d)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, c + q_len, -1, self.d)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, c + q_len, -1, self.d)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        mask = None
        if self.causal or self.window is not None:
            qp = c + torch.arange(q_len)[:, None]
            kp = torch.arange(c + q_len)[None, :]
            mask = torch.ones(q_len, c + q_len, dtype=torch.bool)
            if self.causal:
                mask &= kp <= qp
            if self.window is not None:
                mask &= qp - kp < self.window
                if not self.causal:
                    mask &= kp - qp < self.window
        k, v = k.repeat_interleave(self.groups, 1), v.repeat_interleave(self.groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.d**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class _Layer(nn.Module):
    def __init__(self, cfg, layer: int, layer_types: list[str]):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        self.self_attn = _Attention(cfg, layer, layer_types)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class RefDrafter(nn.Module):
    """The z-lab drafter from its config.json + model.safetensors."""

    def __init__(self, directory: str | Path):
        super().__init__()
        import transformers
        from safetensors.torch import load_file
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        raw = json.loads((Path(directory) / "config.json").read_text())
        cfg = transformers.Qwen3Config(**raw)
        layer_types = raw.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
        dflash = raw.get("dflash_config", {})
        self.tap_ids = dflash["target_layer_ids"]
        self.mask_token_id = dflash["mask_token_id"]
        self.block_size = int(dflash.get("block_size", raw["block_size"]))
        self.layers = nn.ModuleList(_Layer(cfg, i, layer_types) for i in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(self.tap_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)
        self.load_state_dict(load_file(str(Path(directory) / "model.safetensors")))  # strict: every weight
        self.eval()

    def features(self, hidden_states) -> torch.Tensor:
        """The official extract_context_feature: hidden_states[i + 1] for every tap id."""
        return torch.cat([hidden_states[i + 1] for i in self.tap_ids], -1)

    def draft(self, target, context: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """Argmax drafts [K-1] for block [1, K] whose anchor sits right after `context` [1, C, T*H]."""
        c, k = context.shape[1], block.shape[1]
        x = target.get_input_embeddings()(block)
        ctx = self.hidden_norm(self.fc(context))
        cos, sin = self.rotary_emb(x, torch.arange(c + k)[None])
        for layer in self.layers:
            x = layer(x, ctx, cos, sin)
        return target.lm_head(self.norm(x)[:, 1:]).argmax(-1)[0]


@torch.inference_mode()
def zlab_generate(target, drafter: RefDrafter, prompt: list[int], max_new_tokens: int,
                  raw_last: bool = False) -> tuple[list[int], list[int]]:
    """-> (new tokens, acceptance lengths) of the official greedy loop.

    `raw_last` swaps the last hidden state for the raw output of the last decoder layer
    (before the final norm): the mistake the official semantics rule out, for showing that a
    comparison can tell the two apart.
    """
    from transformers import DynamicCache

    raw = {}
    if raw_last:
        last = target.model.layers[-1]
        hook = last.register_forward_hook(lambda m, a, o: raw.__setitem__(0, o[0] if isinstance(o, tuple) else o))
    try:
        return _loop(target, drafter, prompt, max_new_tokens, DynamicCache,
                     lambda hs: drafter.features((*hs[:-1], raw[0]) if raw_last else hs))
    finally:
        if raw_last:
            hook.remove()


def _loop(target, drafter, prompt, max_new_tokens, DynamicCache, features):

    n, k = len(prompt), drafter.block_size
    max_length = n + max_new_tokens
    out = torch.full((1, max_length + k), drafter.mask_token_id, dtype=torch.long)
    out[0, :n] = torch.tensor(prompt)
    pos = torch.arange(max_length + k)[None]
    cache = DynamicCache()
    o = target(out[:, :n], position_ids=pos[:, :n], past_key_values=cache, use_cache=True, output_hidden_states=True)
    out[0, n] = o.logits[0, -1].argmax()
    context = features(o.hidden_states)
    lengths, start = [], n
    while start < max_length:
        block = out[:, start : start + k].clone()
        block[0, 1:] = drafter.draft(target, context, block)
        o = target(block, position_ids=pos[:, start : start + k], past_key_values=cache, use_cache=True,
                   output_hidden_states=True)
        posterior = o.logits[0].argmax(-1)
        a = int((block[0, 1:] == posterior[:-1]).int().cumprod(0).sum())
        out[0, start : start + a + 1] = block[0, : a + 1]
        out[0, start + a + 1] = posterior[a]
        start += a + 1
        remove = cache.get_seq_length() - start  # the official _crop_to (transformers 5 crops by a negative count)
        if remove > 0:
            cache.crop(-remove)
        lengths.append(a + 1)
        context = torch.cat([context, features(o.hidden_states)[:, : a + 1]], 1)
    return out[0, n : min(start + 1, max_length)].tolist(), lengths


def assert_rounds_match(ours: list[int], official: list[int], max_new_tokens: int) -> None:
    """Round for round, except a last round cut to the token budget.

    Ours never emits past the budget, so its last round is `min(official, room left)`; when
    the official rounds use the budget up exactly, the official loop (`while start <
    max_length`) runs one more round whose tokens all fall past the budget, and ours stops.
    """
    n = len(ours)
    assert 1 + sum(ours) == max_new_tokens, "compare runs that end on the budget (no stop tokens)"
    assert ours[:-1] == official[: n - 1], (ours, official)
    assert ours[-1] == min(official[n - 1], max_new_tokens - 1 - sum(ours[:-1])), (ours, official)
    exactly_used = 1 + sum(official[:n]) == max_new_tokens
    assert len(official) == n + exactly_used, (ours, official)
