"""Configs of the drafters: z-lab DFlash checkpoints and speculators "dflash" ones (read into the
same record). Strict like the targets' (models/config.py): what is not implemented is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.errors import DFlashError
from . import speculators
from .config import DRAFT2_ARCH, DRAFT_ARCH, MOE_ARCHS, TARGET_ARCHS, TargetConfig, read_config, required
from .rope import Rope, parse_rope


def not_a_drafter(arch) -> str:
    """Why a checkpoint of architecture `arch` is not a drafter, in words."""
    if arch in TARGET_ARCHS or arch in MOE_ARCHS or str(arch).endswith("ForCausalLM"):
        return (f"architecture {arch!r} is a language model (a target?), not a DFlash drafter "
                f"({DRAFT_ARCH}, {DRAFT2_ARCH} or a speculators \"dflash\" checkpoint)")
    return (f"architecture {arch!r} is not supported (supported: {DRAFT_ARCH}, {DRAFT2_ARCH}), nor is this a "
            "speculators \"dflash\" checkpoint")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The z-lab rule: one layer -> the middle one; else spread evenly over [1, L-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DraftConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: Rope
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int
    mask_token_id: int | None
    layer_types: list[str]
    sliding_window: int | None
    is_causal: bool | None  # None: sliding layers causal, full layers not (z-lab rule)
    vocab_size: int | None = None
    output_multiplier: float = 1.0  # draft logits times this, then
    final_logit_softcapping: float | None = None  # cap * tanh(logits / cap) (None: off)
    input_embedding_scale: float = 1.0  # the block's embedding (the target's table) times this
    attention_bias: bool = False  # q/k/v/o projections with biases (gpt-oss drafters)
    raw: dict = field(default_factory=dict, repr=False)  # the original config, saved back as is
    format: str = "z-lab"  # or "speculators" (models/speculators.py): the checkpoint's layout
    draft_vocab_size: int | None = None  # speculators: the N tokens its own head scores (d2t); None: all
    verifier: str | None = None  # speculators: the target it was made for (speculators_config.verifier)

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "drafter") -> "DraftConfig":
        if speculators.is_speculators(cfg):
            z, extra = speculators.config_dict(cfg, where)
            out = cls.from_dict(z, where)
            out.raw, out.format = cfg, "speculators"
            out.draft_vocab_size, out.verifier = extra["draft_vocab_size"], extra["verifier"]
            return out
        archs = cfg.get("architectures") or [DRAFT_ARCH]
        if archs[0] != DRAFT_ARCH:
            raise DFlashError(f"{where}: {not_a_drafter(archs[0])}")
        nested = cfg.get("dflash_config") or {}
        unsupported = [k for k in ("selector_rank", "conv_kernel_size", "conv_group_size")
                       if nested.get(k, cfg.get(k)) is not None]
        if unsupported:
            raise DFlashError(f"{where}: DFlash2 features are not supported: {', '.join(unsupported)} (under "
                              f"{archs[0]}; a DFlash 2 drafter's architecture is {DRAFT2_ARCH})")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise DFlashError(f"{where}: hidden_act {act!r} is not supported (only silu)")
        layers = int(required(cfg, "num_hidden_layers", where))
        heads = int(required(cfg, "num_attention_heads", where))
        hidden = int(required(cfg, "hidden_size", where))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if layers < 1 or heads % kv_heads:
            raise DFlashError(f"{where}: needs >= 1 layer and num_attention_heads divisible by num_key_value_heads")
        num_target_layers = cfg.get("num_target_layers")
        tap_ids = nested.get("target_layer_ids", cfg.get("target_layer_ids"))
        if tap_ids is None:
            if num_target_layers is None:
                raise DFlashError(f"{where}: config has neither dflash_config.target_layer_ids nor num_target_layers")
            tap_ids = default_target_layer_ids(int(num_target_layers), layers)
        block = nested.get("block_size", cfg.get("block_size", 16))  # z-lab's default
        if int(block) < 1:
            raise DFlashError(f"{where}: block_size must be >= 1 (got {block})")
        mask = nested.get("mask_token_id", cfg.get("mask_token_id"))
        # the logit transforms and the block's embedding scale, as z-lab reads them (dflash_config
        # first, then the top level); absent, 1 / 0 / None: no-ops, exactly the drafter without them
        knob = {k: nested.get(k, cfg.get(k)) for k in ("output_multiplier", "final_logit_softcapping",
                                                       "input_embedding_scale")}
        try:
            mult, scale = (float(1.0 if knob[k] is None else knob[k]) for k in ("output_multiplier", "input_embedding_scale"))
            cap = float(knob["final_logit_softcapping"] or 0.0)
        except (TypeError, ValueError):
            raise DFlashError(f"{where}: output_multiplier, final_logit_softcapping and input_embedding_scale must be "
                              f"numbers (got {knob})") from None
        if cap < 0:
            raise DFlashError(f"{where}: final_logit_softcapping must be >= 0 (got {cap}); 0 or absent disables it")
        # as transformers' Qwen3Config (which z-lab's drafter uses): no window unless
        # use_sliding_window; without layer_types, layers >= max_window_layers slide
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if window and i >= cfg.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)
        ]
        if len(layer_types) != layers:
            raise DFlashError(f"{where}: layer_types has {len(layer_types)} entries for {layers} layers")
        bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise DFlashError(f"{where}: layer type(s) {bad} are not supported")
        return cls(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(required(cfg, "intermediate_size", where)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(cfg, where),
            target_layer_ids=[int(i) for i in tap_ids],
            num_target_layers=int(num_target_layers) if num_target_layers is not None else -1,
            block_size=int(block),
            mask_token_id=None if mask is None else int(mask),
            layer_types=list(layer_types),
            sliding_window=int(window) if window else None,
            is_causal=cfg.get("is_causal"),
            vocab_size=cfg.get("vocab_size"),
            output_multiplier=mult,
            final_logit_softcapping=cap or None,
            input_embedding_scale=scale,
            attention_bias=bool(cfg.get("attention_bias", False)),
            raw=cfg,
        )

    @classmethod
    def load(cls, directory: str | Path) -> "DraftConfig":
        return cls.from_dict(read_config(directory, "drafter"), where=f"drafter {directory}")

    family = "dflash"  # "dflash2": DFlash2Config (models/dflash2.py), drafts from the selector's walk

    def layer_window(self, j: int) -> int | None:
        return self.sliding_window if self.layer_types[j] == "sliding_attention" else None

    def layer_causal(self, j: int) -> bool:
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[j] == "sliding_attention"

    def check_fits(self, target: TargetConfig, where: str = "drafter") -> None:
        """Refuse a drafter that cannot be attached to this target (`where` names it, revision included)."""
        made_for = f" (made for {self.verifier})" if self.verifier else ""
        if self.hidden_size != target.hidden_size:
            raise DFlashError(
                f"{where}: hidden_size {self.hidden_size} does not match the target's {target.hidden_size}; "
                f"this drafter was trained for another target{made_for}"
            )
        if self.num_target_layers not in (-1, target.num_layers):
            raise DFlashError(
                f"{where}: num_target_layers {self.num_target_layers} does not match the target's "
                f"{target.num_layers} layers; this drafter was trained for another target{made_for}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise DFlashError(f"{where}: target_layer_ids {bad} are outside the target's {target.num_layers} layers"
                              f"{made_for}")
        if self.vocab_size not in (None, target.vocab_size):
            raise DFlashError(
                f"{where}: vocab_size {self.vocab_size} does not match the target's {target.vocab_size}{made_for}"
            )
        if self.block_size > target.max_position_embeddings:
            raise DFlashError(f"{where}: block_size {self.block_size} exceeds the target's context "
                              f"(max_position_embeddings {target.max_position_embeddings}){made_for}")

    def resolve_mask_token_id(self, override: int | None = None) -> int:
        if override is not None:
            return int(override)
        if self.mask_token_id is None:
            raise DFlashError(
                "the drafter config has no mask_token_id (dflash_config.mask_token_id is null or absent); "
                "pass --mask-token-id ID (the id of the tokenizer's mask token)"
            )
        return self.mask_token_id
