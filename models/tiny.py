"""Tiny checkpoints in the real formats, built on the fly (no downloads, ever).

Used by the tests, the benchmarks and tools/ (`from dflash_export.models.tiny import make_target`);
needs the export and dev extras (torch, transformers).

Targets are saved by transformers' own `save_pretrained` (the Hugging Face format as
people have it); drafters by our z-lab writer. Weights are random but not degenerate:
a scaled init gives peaked logits so greedy decoding is stable against float noise.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.lazy import lazy_import
from .config import TargetConfig
from .drafter import new_drafter

# torch, transformers: on first use (runtime/lazy.py)
torch = lazy_import("torch")
transformers = lazy_import("transformers")
safetensors_torch = lazy_import("safetensors.torch")

ARCHS = ("llama", "qwen2", "qwen3")
HYBRID = ("qwen35", "qwen35-vl")  # Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration (hybrid)
WINDOWED = ("gpt_oss", "gemma4")  # GptOssForCausalLM / Gemma4ForCausalLM (sliding + full attention)
# mixture-of-experts (models/moe.py): Qwen3MoeForCausalLM; Qwen3_5MoeForCausalLM / ...ForConditionalGeneration;
# Qwen3NextForCausalLM (hybrids with a shared expert)
MOE = ("qwen3_moe", "qwen35_moe", "qwen35_moe-vl", "qwen3_next")


def make_target(
    directory: str | Path,
    arch: str = "qwen3",
    seed: int = 0,
    vocab: int = 101,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 112,
    tie: bool | None = None,
    llama3_rope: bool = True,
    sharded: bool = False,
    std: float = 0.08,
    layer_types: list[str] | None = None,
    linear: dict | None = None,
    window: int = 4,
    extra: dict | None = None,
    moe: dict | None = None,
    fused_experts: bool = False,
) -> Path:
    """Write a random HF checkpoint of `arch`; returns the directory. Hybrid archs: `linear`
    overrides the Gated DeltaNet config fields (e.g. Qwen3.5's real widths). MoE
    archs: `moe` overrides the expert config fields (num_experts, num_experts_per_tok,
    moe_intermediate_size, norm_topk_prob, mlp_only_layers, ...); save_pretrained writes one
    key per expert, as released checkpoints have them; `fused_experts` writes transformers
    5.x's in-memory layout instead (gate_up_proj [E, 2I, H], down_proj [E, H, I]).
    gpt_oss / gemma4: `window` is the sliding window, `extra` overrides config fields (e.g.
    Gemma 4's num_kv_shared_layers, hidden_size_per_layer_input, attention_k_eq_v)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        eos_token_id=vocab - 1,
        bos_token_id=0,
    )
    if arch == "llama":
        extra = {}
        if llama3_rope:
            extra["rope_scaling"] = {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            }
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True if tie is None else tie,
                                       rope_theta=500000.0, head_dim=head_dim or hidden // heads, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=bool(tie))
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=head_dim or 32, tie_word_embeddings=bool(tie))
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch in HYBRID:
        model = _qwen35(arch, common, layer_types, head_dim or 16, bool(tie), linear or {})
    elif arch in WINDOWED:
        model = _windowed(arch, common, layer_types, head_dim or 16, tie, window, extra or {})
    elif arch in MOE:
        model = _moe(arch, common, layer_types, head_dim or 16, bool(tie), linear or {}, moe or {})
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-2.0, 1.0)  # decays exp(-e^A softplus(.)): from slow to fast forgetting
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
            elif p.dim() > 1:
                p.normal_(0.0, std * (3.0 if "conv1d" in name else 1.0))
            elif name.endswith(("router.scale", "per_expert_scale")):
                p.uniform_(0.5, 1.5)  # Gemma 4's router scales: far from 0, so the experts count
            elif "norm" in name and arch in HYBRID + MOE[1:] and "linear_attn" not in name:
                p.uniform_(-0.2, 0.2)  # (1 + w) norms
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    directory = Path(directory)
    model.eval().save_pretrained(directory, max_shard_size="20KB" if sharded else "10GB")
    if fused_experts:  # the in-memory state dict as it is: fused experts under transformers 5.x's names
        for f in [*directory.glob("*.safetensors"), *directory.glob("*.safetensors.index.json")]:
            f.unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
        safetensors_torch.save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _hybrid_text(common: dict, layer_types, head_dim: int, tie: bool, linear: dict, **more) -> dict:
    """The text config of a tiny Qwen3.5-style hybrid: every fourth layer full attention, the
    rest Gated DeltaNet; partial rotary; `linear` and `more` override or add."""
    layers = common["num_hidden_layers"]
    text = dict(
        **common, head_dim=head_dim, tie_word_embeddings=tie,
        layer_types=layer_types or ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                   "partial_rotary_factor": 0.5},
        **more,
    )
    text.update(linear)
    return text


def _tiny_vision(hidden: int) -> dict:
    """The smallest vision tower a Qwen3.5 vision-language wrapper takes (its text model is what we load)."""
    return dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                patch_size=4, num_position_embeddings=16)


def _qwen35(arch: str, common: dict, layer_types, head_dim: int, tie: bool, linear: dict):
    """A tiny hybrid Qwen3.5 with transformers' own classes (partial rotary, gated attention, GDN)."""
    text = _hybrid_text(common, layer_types, head_dim, tie, linear)
    if arch == "qwen35":
        return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    vision = _tiny_vision(common["hidden_size"])
    return transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie))


def _windowed(arch: str, common: dict, layer_types, head_dim: int, tie, window: int, extra: dict):
    """A tiny gpt-oss (4 experts, top 2, YaRN as released) or Gemma 4 (full layers twice the head
    dim with one KV head, k_eq_v, soft-capped logits; no per-layer embeddings unless `extra`)."""
    common = {**common, "head_dim": head_dim, "sliding_window": window}
    if layer_types:
        common["layer_types"] = layer_types
    if arch == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                        tie_word_embeddings=bool(tie), **extra)
        return transformers.GptOssForCausalLM(cfg)
    cfg = dict(common, global_head_dim=2 * head_dim, num_global_key_value_heads=1, attention_k_eq_v=True,
               final_logit_softcapping=30.0, hidden_size_per_layer_input=0, tie_word_embeddings=tie is not False)
    cfg.update(extra)
    return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**cfg))


def _moe(arch: str, common: dict, layer_types, head_dim: int, tie: bool, linear: dict, moe: dict):
    """A tiny MoE target with transformers' own classes: 4 experts of width 16, 2 per token,
    a shared expert of width 24 where the family has one."""
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **moe)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=head_dim, tie_word_embeddings=tie, **experts)
        return transformers.Qwen3MoeForCausalLM(cfg)
    text = _hybrid_text(common, layer_types, head_dim, tie, linear, shared_expert_intermediate_size=24, **experts)
    if arch == "qwen3_next":
        return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**text))
    text.pop("intermediate_size")  # Qwen3.5-MoE has no dense MLP
    if arch == "qwen35_moe":
        return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    vision = _tiny_vision(common["hidden_size"])
    return transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie))


def make_drafter(
    directory: str | Path,
    target_dir: str | Path,
    layers: int = 1,
    block_size: int = 4,
    seed: int = 0,
    mask_token_id: int | None = None,
    **kwargs,
) -> Path:
    """Write a random z-lab-format drafter sized for the target at `target_dir`."""
    torch.manual_seed(seed)
    tc = TargetConfig.load(target_dir)
    mask = tc.vocab_size - 2 if mask_token_id is None else mask_token_id
    drafter = new_drafter(tc, num_layers=layers, block_size=block_size, mask_token_id=mask, **kwargs)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    drafter.save_pretrained(directory)
    return Path(directory)


def hf_model(directory: str | Path):
    """transformers' own model for a tiny target directory (the reference implementation)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
