"""The DFlash drafter (z-lab `DFlashDraftModel` format), split the way it is deployed.

Two pieces, each a pure function of its inputs:

- `context_kv`: target taps of newly accepted positions -> `fc` -> `hidden_norm` -> per
  drafter layer K/V (k_norm + RoPE at their true positions). Context features never pass
  through the drafter's MLPs; the caller appends these K/V to its context cache.
- `block`: the block `[anchor, MASK, ...]` embedded with the target's `embed_tokens`,
  through every layer with queries from the block and keys/values from
  `[context cache ; block]`, non-causal inside the block (sliding layers: see `block_mask`).
  The target's `lm_head` maps positions 1..K-1 to the draft logits.

The drafter owns no embedding and no LM head: they are passed in from the target (the
block's embedding times `input_embedding_scale`, the logits through `transform_logits`
when the config sets them). With a
reduced draft vocabulary (`set_draft_vocab`) it scores only N candidate tokens with its
own [N, H] slice of the target's head and maps the argmax back to target ids
(`draft_tokens`); the target still verifies every draft, so the output is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..runtime.errors import DFlashError
from . import speculators
from .checkpoint import load_state_dict, save_state_dict, strict_load
from .config import DRAFT_ARCH, TargetConfig
from .draft_config import DraftConfig, default_target_layer_ids
from .layers import MLP, RMSNorm, apply_rope, attend, rope_cos_sin

KV = list[tuple[torch.Tensor, torch.Tensor]]


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.h, self.hkv, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, s, _ = x.shape
        k = apply_rope(self.k_norm(self.k_proj(x).view(b, s, self.hkv, self.d)), cos, sin)
        return k, self.v_proj(x).view(b, s, self.hkv, self.d)


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Drafter(nn.Module):
    config_type = DraftConfig  # what from_pretrained reads (DFlash2Drafter: DFlash2Config)

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", c.rope.inv_freq(c.head_dim), persistent=False)
        self.register_buffer("vocab_ids", None, persistent=False)  # [N] target ids a reduced head scores
        self.register_buffer("vocab_head", None, persistent=False)  # [N, H] those rows of the target's lm_head
        self.borrowed: dict[str, torch.Tensor] = {}  # speculators: its copies of the target's tensors, until `attach`

    def set_draft_vocab(self, ids: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Score only the target ids `ids` (a gathered copy of their LM head rows, stored once)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        self.vocab_ids = ids.clone()
        self.vocab_head = lm_head_weight.detach()[ids].clone()

    def attach(self, target, where: str = "drafter") -> None:
        """Refuse a target whose embedding / LM head are not the ones this drafter's checkpoint
        copied (speculators drafters carry both; the graphs read the target's); then forget the copies."""
        theirs = {"embed_tokens.weight": target.model.embed_tokens.weight, "lm_head.weight": target.lm_head.weight}
        for name, mine in self.borrowed.items():
            ref = theirs[name].detach().float()
            if tuple(mine.shape) != tuple(ref.shape) or (mine.float() - ref).abs().max() > 1e-2 * ref.abs().max():
                made_for = f" (made for {self.config.verifier})" if self.config.verifier else ""
                raise DFlashError(f"{where}: its {name} is not the target's copy: this drafter was made for another "
                                  f"target{made_for}")
        self.borrowed = {}

    def empty_kv(self, batch: int = 1) -> KV:
        c = self.config
        z = self.fc.weight.new_zeros(batch, 0, c.num_kv_heads, c.head_dim)
        return [(z, z) for _ in range(c.num_layers)]

    def context_kv(self, taps: torch.Tensor, ctx_position_ids: torch.Tensor) -> KV:
        """taps [B,C,T*H] of accepted positions -> per layer (k, v) [B,C,Hkv,D] to append."""
        ctx = self.hidden_norm(self.fc(taps))
        cos, sin = rope_cos_sin(ctx_position_ids, self.inv_freq, ctx.dtype, self.config.rope.attention_factor)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_mask(self, j: int, ctx_len: int, k: int, anchors: torch.Tensor | None = None, device=None,
                   ring: int | None = None):
        """Which keys each block query of layer j sees: [K, C+K] (inference), [N, K or 1, C+K]
        (training), or None when it sees them all. One rule for both, as z-lab builds it.

        Keys are the C context slots (slot == position) then the block at positions a..a+K-1,
        a the anchor's position. Inference (`anchors` None): the context holds exactly the
        positions before the anchor, so a = C. Training: N blocks share one sequence-long
        context, and row i hides slots >= its anchor (their features do not exist yet at
        inference). Full-attention layers see the rest (non-causal); sliding layers are causal
        unless the config says `is_causal`, and see only keys within `sliding_window`.
        `ring` (exports of all-sliding drafters, Manifest.draft_ring; with `anchors`): the context
        cache is a ring of that many slots, slot s holding the last position = s mod ring.
        """
        window, causal = self.config.layer_window(j), self.config.layer_causal(j)
        if anchors is None and window is None and not causal:
            return None
        offsets = torch.arange(k, device=device)
        q = (ctx_len + offsets)[None] if anchors is None else anchors[:, None] + offsets  # [N, K] query positions
        n = q.shape[0]
        ctx = torch.arange(ctx_len, device=device)[None].expand(n, ctx_len)
        if ring is not None and anchors is not None:  # a ring of slots: slot s holds the last position = s mod ring
            last = anchors[:, None] - 1
            # (+ ring: a non-negative operand, as ONNX exports of an integer remainder need; slots < ring)
            ctx = last - torch.remainder(last - ctx + ring, ring)  # < 0: not written yet (hidden below)
        t = torch.cat([ctx, q], 1)[:, None, :]  # [N, 1, C+K] key positions
        q = q[:, :, None]
        visible = torch.ones(n, 1, ctx_len + k, dtype=torch.bool, device=device)  # broadcast over queries
        if anchors is not None:  # context slots at or after the anchor are hidden; the block is not
            seen = ctx < anchors[:, None]
            if ring is not None:
                seen = seen & (ctx >= 0)
            visible = visible & torch.cat([seen, torch.ones(n, k, dtype=torch.bool, device=device)], 1)[:, None, :]
        if causal:
            visible = visible & (t <= q)
        if window is not None:
            visible = visible & (q - t < window)
            if not causal:
                visible = visible & (t - q < window)
        return visible[0] if anchors is None else visible

    def block(self, block_emb: torch.Tensor, block_position_ids: torch.Tensor, past_ctx: KV,
              anchors: torch.Tensor | None = None, position_major: bool = False, ring: int | None = None) -> torch.Tensor:
        """Embedded block [B,K,H] over the context cache -> final hidden states [B,K,H].

        Training passes `anchors` [B]: each row's context is then a whole sequence's, and
        `block_mask` hides what lies at or after the row's anchor.
        """
        x = block_emb
        b, k, _ = x.shape
        cos, sin = rope_cos_sin(block_position_ids, self.inv_freq, x.dtype, self.config.rope.attention_factor)
        p = past_ctx[0][0].shape[0 if position_major else 1]
        for j, layer in enumerate(self.layers):
            a = layer.self_attn
            h, late = self.wrap_in(layer, "attention", layer.input_layernorm(x))
            q = apply_rope(a.q_norm(a.q_proj(h).view(b, k, a.h, a.d)), cos, sin)
            kb, vb = a.kv(h, cos, sin)
            if position_major:  # the ragged graph's cache [P, B, ...]: join on that axis, one transpose after
                keys = torch.cat([past_ctx[j][0], kb.transpose(0, 1)], 0).transpose(0, 1)
                values = torch.cat([past_ctx[j][1], vb.transpose(0, 1)], 0).transpose(0, 1)
            else:
                keys = torch.cat([past_ctx[j][0].to(kb.dtype), kb], 1)  # .to: autocast training
                values = torch.cat([past_ctx[j][1].to(vb.dtype), vb], 1)
            y = a.o_proj(attend(q, keys, values, self.block_mask(j, p, k, anchors, x.device, ring)))
            x = x + self.wrap_out(layer, "attention", y, late)
            h, late = self.wrap_in(layer, "mlp", layer.post_attention_layernorm(x))
            x = x + self.wrap_out(layer, "mlp", layer.mlp(h), late)
        return self.norm(x)

    def wrap_in(self, layer, sublayer: str, h: torch.Tensor):
        """A sublayer's input as it enters (DFlash 2 convolves it here) and what `wrap_out` needs."""
        return h, None

    def wrap_out(self, layer, sublayer: str, y: torch.Tensor, late) -> torch.Tensor:
        """A sublayer's output before the residual add (DFlash 2 convolves it here)."""
        return y

    def draft_logits(self, target, block_ids: torch.Tensor, block_position_ids: torch.Tensor, past_ctx: KV,
                     ctx_lengths: torch.Tensor | None = None, position_major: bool = False, ring: int | None = None,
                     index: torch.Tensor | None = None):
        """Logits [B,K-1,V] (fp32) for the masked positions, with the target's embedding and head
        ([B,K-1,N] over the draft vocabulary when one is set). `ctx_lengths` [B]: each row's
        valid context (a ragged batch: slot == position, so it is the row's anchor position).
        `index` [n]: only those draft positions go through the head ([B,n,V]; the head's MatMul
        shrinks with them, contract.DRAFT_INDEX)."""
        hidden = self.draft_hidden(target, block_ids, block_position_ids, past_ctx, ctx_lengths, position_major, ring)
        return self.head(target, hidden if index is None else hidden.index_select(1, index))

    def draft_hidden(self, target, block_ids: torch.Tensor, block_position_ids: torch.Tensor, past_ctx: KV,
                     ctx_lengths: torch.Tensor | None = None, position_major: bool = False,
                     ring: int | None = None) -> torch.Tensor:
        """Final hidden states [B,K-1,H] of the masked positions (`draft_logits`' arguments)."""
        emb = target.embed(block_ids)
        if self.config.input_embedding_scale != 1.0:
            emb = emb * self.config.input_embedding_scale
        return self.block(emb, block_position_ids, past_ctx, ctx_lengths, position_major, ring)[:, 1:]

    def head(self, target, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states -> draft logits (fp32, after the config's transforms)."""
        if self.vocab_head is not None:
            return self.transform_logits(torch.nn.functional.linear(hidden, self.vocab_head).float())
        return self.transform_logits(target.lm_head(hidden).float())

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The config's `output_multiplier`, then `cap * tanh(x / cap)` (final_logit_softcapping),
        as z-lab's `compute_logits`; absent: the logits unchanged (not even an op in the graph).
        Per token, so a reduced draft vocabulary gets exactly its tokens' full-vocabulary values."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def draft_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Target token ids of the drafts: argmax of `draft_logits`, mapped back from the draft vocabulary."""
        best = logits.argmax(-1)
        return best if self.vocab_ids is None else self.vocab_ids[best]

    def block_outputs(self, target, block_ids: torch.Tensor, block_position_ids: torch.Tensor, past_ctx: KV,
                      ctx_lengths: torch.Tensor | None = None, position_major: bool = False, ring: int | None = None,
                      index: torch.Tensor | None = None):
        """What draft_block returns, in the contract's order: draft ids, logits (fp32) and
        draft_conf (the top-1 probability per position: adaptive verify's input); `index`: of
        those draft positions only."""
        logits = self.draft_logits(target, block_ids, block_position_ids, past_ctx, ctx_lengths, position_major, ring,
                                   index)
        return self.draft_tokens(logits), logits, torch.softmax(logits, -1).amax(-1)

    # -- z-lab format -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32,
                        config: DraftConfig | None = None) -> "Drafter":
        """`config`: the directory's own config.json if the caller parsed it already (load_draft_config)."""
        if config is None:
            config = cls.config_type.load(directory)
        elif type(config) is not cls.config_type:
            raise DFlashError(f"drafter {directory}: a {type(config).__name__} cannot build a {cls.__name__}; "
                              "load it with models.dflash2.load_drafter")
        with torch.device("meta"):
            model = cls(config)
        state = load_state_dict(directory, "drafter")
        if config.format == "speculators":  # its own head, vocabulary map and copies of the target's tensors
            state, own = speculators.split_state(state, config, f"drafter {directory}")
        strict_load(model, state, f"drafter {directory}", dtype)
        model.inv_freq = config.rope.inv_freq(config.head_dim)
        if config.format == "speculators":
            if own["embed"] is not None:
                model.borrowed["embed_tokens.weight"] = own["embed"]
            if own["ids"] is not None:  # the reduced head it was trained with: what `set_draft_vocab` builds
                model.vocab_ids, model.vocab_head = own["ids"], own["head"].to(dtype)
            else:
                model.borrowed["lm_head.weight"] = own["head"]
        return model.eval()

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json + model.safetensors in the z-lab layout (loadable by z-lab's code)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(self.config.raw, indent=2) + "\n")
        save_state_dict(self.state_dict(), d / "model.safetensors")


def draft_config_dict(
    target: TargetConfig,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    attention_bias: bool | None = None,
) -> dict:
    """A fresh drafter config in the z-lab layout, sized for `target` (training, tests);
    `attention_bias` None: as the family's released drafters (gpt-oss's have biases)."""
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(target.num_layers, num_layers)
    heads = num_heads or target.num_heads
    cfg = {
        "architectures": [DRAFT_ARCH],
        "model_type": "qwen3",
        "attention_bias": target.family == "gpt_oss" if attention_bias is None else attention_bias,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        # a target without a dense MLP (Qwen3.5-MoE: experts only) gives the drafter 3x its width
        "intermediate_size": intermediate_size or target.intermediate_size or 3 * target.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": num_kv_heads or target.num_kv_heads,
        "head_dim": head_dim or target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope.theta,
        "rope_scaling": None,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "num_target_layers": target.num_layers,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id},
        "layer_types": layer_types or ["full_attention"] * num_layers,
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
        "dtype": "float32",
    }
    r = target.rope
    if r.kind == "proportional":  # Gemma 4: its full layers' partial RoPE is theirs; drafters rotate whole heads
        cfg["rope_theta"] = r.theta
    elif r.kind == "yarn":  # gpt-oss: its drafters are released with the target's YaRN
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": r.factor, "beta_fast": r.beta_fast, "beta_slow": r.beta_slow,
                               "original_max_position_embeddings": r.original_max_position, "truncate": r.truncate}
    elif r.kind != "default":  # the drafter rotates at the target's positions: same RoPE
        cfg["rope_scaling"] = {
            "rope_type": r.kind,
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position,
        }
    return cfg


def new_drafter(target: TargetConfig, **kwargs) -> Drafter:
    """A randomly initialised drafter for `target` (std 0.02, norms at 1)."""
    config = DraftConfig.from_dict(draft_config_dict(target, **kwargs))
    model = Drafter(config)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    return model
