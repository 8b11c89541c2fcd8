"""Configs of the targets people actually have: Hugging Face checkpoints of every supported family
(dense Llama / Qwen2 / Qwen3, the Qwen3.5 hybrids, mixture-of-experts, gpt-oss and Gemma 4).
The drafters' configs are in models/draft_config.py, RoPE's in models/rope.py.

Parsing is strict: anything we do not implement is refused with one line that names it,
so nothing is ever loaded half-way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.errors import DFlashError
from ..runtime.files import read_json
from . import speculators
from .rope import Rope, parse_rope

TARGET_ARCHS = {
    # architecture -> (q/k/v bias default, per-head q/k RMSNorm)
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    # hybrid Qwen3.5 / 3.6 text model (models/qwen35.py): Gated DeltaNet + gated attention
    "Qwen3_5ForCausalLM": (False, True),
    "Qwen3_5ForConditionalGeneration": (False, True),
    # mixture-of-experts (models/moe.py): Qwen3-MoE (Qwen3 attention), and the hybrids with a
    # shared expert: Qwen3.5 / 3.6-MoE (text model of the VL class too) and Qwen3-Next
    "Qwen3MoeForCausalLM": (False, True),
    "Qwen3_5MoeForCausalLM": (False, True),
    "Qwen3_5MoeForConditionalGeneration": (False, True),
    "Qwen3NextForCausalLM": (False, True),
}
HYBRID_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM")
MOE_ARCHS = ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM")
# per-layer sliding / full attention with their own caches (models/windowed.py): gpt-oss and Gemma 4
WINDOWED_ARCHS = {"GptOssForCausalLM": "gpt_oss", "Gemma4ForCausalLM": "gemma4",
                  "Gemma4ForConditionalGeneration": "gemma4"}
# refused in one line naming what they need (model_type or architecture prefix -> what is missing)
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")
MLA_REASON = ("multi-head latent attention (MLA: compressed K/V with a decoupled RoPE key) and group-limited "
              "expert routing (n_group / topk_group) are not implemented")
DRAFT_ARCH = "DFlashDraftModel"
DRAFT2_ARCH = "DFlash2DraftModel"  # models/dflash2.py


def read_config(directory: str | Path, what: str) -> dict:
    d = Path(directory)
    if not d.is_dir():
        raise DFlashError(f"{what} directory {d} does not exist")
    p = d / "config.json"
    if not p.exists():
        raise DFlashError(f"{what} directory {d} has no config.json; pass a Hugging Face checkpoint directory")
    cfg = read_json(p, "give a Hugging Face checkpoint directory")
    if not isinstance(cfg, dict):
        raise DFlashError(f"{p}: expected a JSON object")
    return cfg


def required(cfg: dict, key: str, where: str):
    if cfg.get(key) is None:
        raise DFlashError(f"{where}: config.json lacks {key!r}")
    return cfg[key]


@dataclass
class LinearAttention:
    """Gated DeltaNet dimensions of a hybrid target's `linear_attention` layers."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:  # channels of the short conv: q, k and v side by side
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass
class MoeConfig:
    """A mixture-of-experts target's routing and expert widths (models/moe.py), as transformers reads them."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    expert_size: int  # moe_intermediate_size: each routed expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the k selected probabilities to sum 1
    shared_expert_size: int = 0  # the shared expert's width, gated by sigmoid(Linear(H -> 1)); 0: none
    sparse_layers: list[int] = field(default_factory=list)  # layers whose MLP is the MoE block (others: dense MLP)
    # what gpt-oss and Gemma 4 differ in (models/moe.py Experts): "swiglu" is act(gate) * (up + beta) with
    # act(g) = g * sigmoid(alpha g), gate clamped above and up both ways at `limit` (None: no clamp); Qwen's
    # alpha 1, beta 0; gpt-oss's 1.702, 1, 7. "geglu": gelu_tanh(gate) * up (Gemma 4)
    activation: str = "swiglu"
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None
    bias: bool = False  # router and experts with biases (gpt-oss)


# config keys of mixture-of-experts variants that are not implemented -> what they would need
_MOE_FEATURES = (
    (lambda c: int(c.get("n_group") or 1) > 1 or int(c.get("topk_group") or 1) > 1,
     "group-limited expert routing (n_group / topk_group)"),
    (lambda c: c.get("kv_lora_rank") is not None or c.get("q_lora_rank") is not None,
     "MLA attention (kv_lora_rank / q_lora_rank)"),
    (lambda c: c.get("scoring_func", "softmax") != "softmax" or c.get("topk_method") == "noaux_tc",
     "sigmoid router scoring with a score-correction bias (scoring_func / topk_method)"),
    (lambda c: float(c.get("routed_scaling_factor") or 1.0) != 1.0, "scaled routed experts (routed_scaling_factor)"),
)


def refuse_unsupported_moe(cfg: dict, arch, where: str) -> None:
    """One line naming every MoE feature of the config we do not run (DeepSeek-V3, Kimi K2, ...)."""
    missing = [what for test, what in _MOE_FEATURES if test(cfg)]
    if missing:
        raise DFlashError(f"{where}: {arch} needs {' and '.join(missing)}, which this exporter does not implement "
                          f"(mixture-of-experts targets supported: {', '.join(MOE_ARCHS)})")


def _moe_fields(cfg: dict, arch: str, layers: int, where: str) -> dict:
    """transformers' routing for the Qwen MoE families, with its defaults for absent keys."""
    qwen35 = arch.startswith("Qwen3_5Moe")  # every layer sparse, top-k always renormalised, a shared expert
    defaults = {"Qwen3MoeForCausalLM": (128, 8, 768, False), "Qwen3NextForCausalLM": (512, 10, 512, True)}.get(
        arch, (256, 8, 512, True))
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts")) or defaults[0])
    top_k = int(cfg.get("num_experts_per_tok") or defaults[1])
    if not 0 < top_k <= experts:
        raise DFlashError(f"{where}: num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = list(range(layers)) if qwen35 else [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    shared = 0 if arch == "Qwen3MoeForCausalLM" else int(cfg.get("shared_expert_intermediate_size") or 512)
    return dict(moe=MoeConfig(
        num_experts=experts, top_k=top_k, expert_size=int(cfg.get("moe_intermediate_size") or defaults[2]),
        norm_topk_prob=True if qwen35 else bool(cfg.get("norm_topk_prob", defaults[3])),
        shared_expert_size=shared, sparse_layers=sparse))


@dataclass
class TargetConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: Rope
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = "float32"
    # hybrid targets only: per-layer "linear_attention" / "full_attention", GDN dims, the
    # fraction of head_dim that RoPE rotates and the sigmoid output gate of attention
    layer_types: list[str] = field(default_factory=list)
    linear: LinearAttention | None = None
    rotary_dim: int = 0
    attn_output_gate: bool = False
    moe: MoeConfig | None = None  # mixture-of-experts targets only (models/moe.py)

    # gpt-oss / Gemma 4 (models/windowed.py): per-layer "sliding_attention" / "full_attention" in
    # layer_types, and what differs from a Llama-style decoder
    windowed: "Windowed | None" = None

    @property
    def hybrid(self) -> bool:
        return self.linear is not None

    @property
    def family(self) -> str:
        """"dense" (Llama / Qwen2 / Qwen3), "hybrid" (Qwen3.5 / 3.6), "gpt_oss" or "gemma4"."""
        return self.windowed.family if self.windowed else "hybrid" if self.hybrid else "dense"

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "target") -> "TargetConfig":
        cfg = {**cfg.get("text_config", {}), **cfg} if "text_config" in cfg and "hidden_size" not in cfg else cfg
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        refuse_unsupported_moe(cfg, arch, where)  # by the config's features; then by name where it lacks them
        if cfg.get("model_type") in MLA_TYPES or str(arch).startswith(("DeepseekV2", "DeepseekV3", "Kimi_K2", "KimiK2")):
            raise DFlashError(f"{where}: {arch or cfg.get('model_type')} is not supported: {MLA_REASON}")
        if arch in WINDOWED_ARCHS:
            return _windowed(cfg, arch, where)
        if arch in (DRAFT_ARCH, DRAFT2_ARCH) or speculators.is_speculators(cfg):
            raise DFlashError(f"{where} is a DFlash drafter ({arch or cfg.get(speculators.KIND)}), not a target: "
                              "pass it as --draft and the model it drafts for as --target")
        if arch not in TARGET_ARCHS:
            raise DFlashError(
                f"{where}: architecture {arch!r} is not supported (supported: {', '.join([*TARGET_ARCHS, *WINDOWED_ARCHS])})"
            )
        if cfg.get("use_sliding_window") and arch != "LlamaForCausalLM":
            raise DFlashError(f"{where}: sliding-window attention in the target is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise DFlashError(f"{where}: hidden_act {act!r} is not supported (only silu)")
        bias_default, qk_norm = TARGET_ARCHS[arch]
        heads = int(required(cfg, "num_attention_heads", where))
        hidden = int(required(cfg, "hidden_size", where))
        if heads % int(cfg.get("num_key_value_heads") or heads):
            raise DFlashError(f"{where}: num_attention_heads must be divisible by num_key_value_heads")
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        attention_bias = bool(cfg.get("attention_bias", bias_default))
        layers = int(required(cfg, "num_hidden_layers", where))
        moe = _moe_fields(cfg, arch, layers, where) if arch in MOE_ARCHS else {}
        # a dense MLP's width: absent where every layer is sparse (Qwen3.5-MoE)
        dense_mlp = bool(not moe or len(moe["moe"].sparse_layers) < layers)
        return cls(
            architecture=arch,
            vocab_size=int(required(cfg, "vocab_size", where)),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(required(cfg, "intermediate_size", where) if dense_mlp else cfg.get("intermediate_size") or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(cfg, where),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if arch != "Qwen2ForCausalLM" else True,
            o_bias=attention_bias if arch != "Qwen2ForCausalLM" else False,  # Qwen3 biases o_proj too
            mlp_bias=bool(cfg.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
            qk_norm=qk_norm,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=eos,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            **(_hybrid_fields(cfg, where) if arch in HYBRID_ARCHS else {}),
            **moe,
        )

    @classmethod
    def load(cls, directory: str | Path) -> "TargetConfig":
        return cls.from_dict(read_config(directory, "target"), where=f"target {directory}")


def _hybrid_fields(cfg: dict, where: str) -> dict:
    """Qwen3.5 text config: layer pattern, GDN dims, partial rotary, output gate (as transformers reads them)."""
    layers = int(required(cfg, "num_hidden_layers", where))
    types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) else "full_attention"
        for i in range(layers)
    ]
    if len(types) != layers:
        raise DFlashError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        raise DFlashError(f"{where}: layer type(s) {bad} are not supported (linear_attention, full_attention)")
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    if not cfg.get("attn_output_gate", True):
        raise DFlashError(f"{where}: attn_output_gate=false is not supported (every released Qwen3.5 gates attention)")
    return dict(
        layer_types=list(types),
        linear=LinearAttention(
            num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
            num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
            key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        ),
        rotary_dim=int(head_dim * factor),
        attn_output_gate=True,
    )


@dataclass
class AttentionKind:
    """The K/V shape, RoPE and window of one kind of attention layer (gpt-oss's sliding and
    full layers share them; Gemma 4's full layers have their own head dim, KV heads and RoPE)."""

    num_kv_heads: int
    head_dim: int
    rope: Rope
    window: int | None  # sliding layers: keys within this many positions (the query's own included)


@dataclass
class Windowed:
    """What a gpt-oss or Gemma 4 target adds to a Llama-style decoder (models/windowed.py)."""

    family: str  # "gpt_oss" | "gemma4"
    kinds: dict[str, AttentionKind]  # "sliding_attention" / "full_attention"
    kv_source: list[int]  # per layer: the layer whose K/V it attends to (itself, or a KV-sharing source)
    sinks: bool = False  # gpt-oss: a learned per-head logit in each softmax's denominator
    attention_scale: float | None = None  # scores' factor (None: head_dim^-0.5; Gemma 4: 1.0)
    k_eq_v: bool = False  # Gemma 4: a full layer's V is its K projection (before k_norm and RoPE)
    embed_scale: float = 1.0  # Gemma 4: the embedding times sqrt(hidden)
    final_logit_softcapping: float | None = None  # Gemma 4: cap * tanh(logits / cap), in the graph
    hidden_act: str = "silu"
    per_layer_input: int = 0  # Gemma 4 per-layer input embeddings: width per layer (0: none)
    per_layer_vocab: int = 0
    double_wide_mlp: bool = False  # Gemma 4: KV-sharing layers' MLP twice as wide

    @property
    def shared_layers(self) -> list[int]:
        """Layers that keep no cache: they attend to an earlier layer's K/V."""
        return [i for i, j in enumerate(self.kv_source) if i != j]


def _windowed(cfg: dict, arch: str, where: str) -> "TargetConfig":
    """A gpt-oss or Gemma 4 target config, strictly (as transformers 5 reads them)."""
    family = WINDOWED_ARCHS[arch]
    if family == "gemma4" and isinstance(cfg.get("text_config"), dict):  # released checkpoints: the multimodal wrapper
        cfg = {**cfg["text_config"], "architectures": [arch], **{k: cfg[k] for k in ("eos_token_id",) if k in cfg}}
    layers = int(required(cfg, "num_hidden_layers", where))
    heads, hidden = int(required(cfg, "num_attention_heads", where)), int(required(cfg, "hidden_size", where))
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    window = int(required(cfg, "sliding_window", where))
    if family == "gpt_oss":
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    else:
        types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                                 for i in range(layers)])
        types[-1:] = ["full_attention"]  # transformers forces the last layer full
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise DFlashError(f"{where}: layer_types must list {layers} of sliding_attention / full_attention (got {types})")
    act = cfg.get("hidden_act" if family == "gpt_oss" else "hidden_activation", "silu" if family == "gpt_oss" else "gelu_pytorch_tanh")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise DFlashError(f"{where}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    common = dict(
        architecture=arch, vocab_size=int(required(cfg, "vocab_size", where)), hidden_size=hidden, num_layers=layers,
        num_heads=heads, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma4")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)), eos_token_ids=eos,
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), layer_types=list(types),
    )
    if family == "gpt_oss":
        rope = parse_rope({**cfg, "rope_theta": cfg.get("rope_theta", 150000.0)}, where)
        kinds = {t: AttentionKind(kv, head_dim, rope, window if t == "sliding_attention" else None) for t in dict.fromkeys(types)}
        bias = bool(cfg.get("attention_bias", True))
        w = Windowed(family, kinds, list(range(layers)), sinks=True, hidden_act=act)
        inter, experts = int(required(cfg, "intermediate_size", where)), int(required(cfg, "num_local_experts", where))
        top_k = int(cfg.get("num_experts_per_tok", 4))
        if not 0 < top_k <= experts:
            raise DFlashError(f"{where}: num_experts_per_tok {top_k} must be between 1 and num_local_experts {experts}")
        # top-k on the biased logits, then a softmax over the k: softmax, top-k, renormalise
        moe = MoeConfig(num_experts=experts, top_k=top_k, expert_size=inter, norm_topk_prob=True,
                        sparse_layers=list(range(layers)), alpha=float(cfg.get("swiglu_alpha", 1.702)), beta=1.0,
                        limit=float(cfg.get("swiglu_limit", 7.0)), bias=True)
        _mxfp4_only(cfg, where)
        return TargetConfig(**common, num_kv_heads=kv, head_dim=head_dim, rope=rope, intermediate_size=inter,
                            qkv_bias=bias, o_bias=bias, windowed=w, moe=moe)
    return _gemma4(cfg, common, types, kv, head_dim, window, act, where)


def _mxfp4_only(cfg: dict, where: str) -> None:
    """gpt-oss's released checkpoints quantize the experts to MXFP4 (models/mxfp4.py dequantises
    them on load); any other quantization_config is refused."""
    q = cfg.get("quantization_config")
    if q and (not isinstance(q, dict) or q.get("quant_method") != "mxfp4"):
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise DFlashError(f"{where}: quantization_config {method!r} is not supported (gpt-oss's own mxfp4 is; "
                          "pass the unquantized checkpoint)")


def _gemma4(cfg: dict, common: dict, types: list[str], kv: int, head_dim: int, window: int, act: str,
            where: str) -> "TargetConfig":
    layers = common["num_layers"]
    if cfg.get("use_bidirectional_attention") == "all":
        raise DFlashError(f"{where}: use_bidirectional_attention='all' (non-causal text attention) is not supported")
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    # the full layers' shape: transformers 5 saves it per layer (per_layer_config); released
    # checkpoints state global_head_dim / num_global_key_value_heads (the latter only with k_eq_v)
    full = {"head_dim": int(cfg.get("global_head_dim", 512))}
    if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
        full["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
    per_layer = cfg.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:
        by_type: dict[str, list] = {}
        for i, t in enumerate(types):
            by_type.setdefault(t, []).append(per_layer.get(str(i), per_layer.get(i, {})))
        bad = [t for t, v in by_type.items() if any(x != v[0] for x in v) or set(v[0]) - {"head_dim", "num_key_value_heads"}]
        if bad or by_type.get("sliding_attention", [{}])[0]:
            raise DFlashError(f"{where}: per_layer_config must give every full_attention layer the same head_dim / "
                              "num_key_value_heads and sliding layers none")
        full = dict(by_type.get("full_attention", [{}])[0])
    rope_params = cfg.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}
    if not all(isinstance(rope_params.get(t), dict) for t in dict.fromkeys(types)):
        raise DFlashError(f"{where}: rope_parameters must hold one entry per layer type (sliding_attention, full_attention)")
    kinds = {
        "sliding_attention": AttentionKind(kv, head_dim, parse_rope({"rope_parameters": rope_params["sliding_attention"]},
                                                                    where), window),
        "full_attention": AttentionKind(int(full.get("num_key_value_heads", kv)), int(full.get("head_dim", head_dim)),
                                        parse_rope({"rope_parameters": rope_params["full_attention"]}, where), None),
    }
    kinds = {t: k for t, k in kinds.items() if t in types}
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first = layers - shared
    source = list(range(layers))
    if shared:
        if not 0 < first:
            raise DFlashError(f"{where}: num_kv_shared_layers {shared} leaves no layer with its own K/V")
        for i in range(first, layers):
            owners = [j for j in range(first) if types[j] == types[i]]
            if not owners:
                raise DFlashError(f"{where}: KV-sharing layer {i} ({types[i]}) has no earlier layer of its type")
            source[i] = owners[-1]
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    cap = cfg.get("final_logit_softcapping")
    w = Windowed("gemma4", kinds, source, attention_scale=1.0, k_eq_v=k_eq_v, embed_scale=common["hidden_size"] ** 0.5,
                 final_logit_softcapping=float(cap) if cap else None, hidden_act=act, per_layer_input=ple,
                 per_layer_vocab=int(cfg.get("vocab_size_per_layer_input") or common["vocab_size"]) if ple else 0,
                 double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)))
    full_kind = kinds.get("full_attention") or kinds["sliding_attention"]
    moe = None
    if cfg.get("enable_moe_block"):  # 26B-A4B: experts beside the dense MLP in every layer
        experts, top_k = int(required(cfg, "num_experts", where)), int(required(cfg, "top_k_experts", where))
        if not 0 < top_k <= experts:
            raise DFlashError(f"{where}: top_k_experts {top_k} must be between 1 and num_experts {experts}")
        if act != "gelu_pytorch_tanh":
            raise DFlashError(f"{where}: Gemma 4 experts with hidden_activation {act!r} are not supported (gelu_pytorch_tanh)")
        moe = MoeConfig(num_experts=experts, top_k=top_k, expert_size=int(required(cfg, "moe_intermediate_size", where)),
                        norm_topk_prob=True, sparse_layers=list(range(layers)), activation="geglu")
    return TargetConfig(**common, moe=moe, num_kv_heads=full_kind.num_kv_heads, head_dim=full_kind.head_dim, rope=full_kind.rope,
                        intermediate_size=int(required(cfg, "intermediate_size", where)),
                        qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
                        qk_norm=True, windowed=w)
