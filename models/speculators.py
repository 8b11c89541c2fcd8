"""DFlash drafters in the speculators format (vllm-project/speculators; RedHatAI's releases).

The same network as z-lab's `DFlashDraftModel`, written another way (as speculators'
`DFlashConverter` and vLLM's `update_dflash` read it):

- config.json: `speculators_model_type: "dflash"`; the drafter's own Qwen3 config under
  `transformer_layer_config` (keys left out take Qwen3Config's defaults, as vLLM builds it);
  `aux_hidden_state_layer_ids` counts the embedding as hidden state 0, so z-lab's
  `target_layer_ids` are those ids - 1; `block_size`, `mask_token_id`; `draft_vocab_size`.
- weights: the z-lab names for the body (`layers.*`, `fc`, `hidden_norm`, `norm`), plus
  copies of the target's `embed_tokens.weight` and LM head (`lm_head.weight`, [draft_vocab_size, H]).
  With a reduced draft vocabulary, `d2t` maps draft index i to target id i + d2t[i] and
  `t2d` marks those target ids: the reduced head of `export --draft-vocab`, chosen by its trainer.

`config_dict` turns the config into the z-lab one (DraftConfig parses it); `split_state`
takes the body for the z-lab module and returns the rest for `Drafter.adopt`.
"""

from __future__ import annotations

from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import

torch = lazy_import("torch")  # split_state only: configs are read without torch

KIND = "speculators_model_type"
# transformers' Qwen3Config defaults for the keys the drafter reads: speculators writes
# transformer_layer_config with to_diff_dict, and vLLM rebuilds it with Qwen3Config(**dict)
QWEN3_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "attention_bias": False, "use_sliding_window": False, "max_window_layers": 28}
WINDOW_KEYS = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")  # newer configs: top level
BORROWED = ("embed_tokens.weight", "lm_head.weight")
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")  # speculators' training targets, unused by drafts


def is_speculators(cfg: dict) -> bool:
    return KIND in cfg


def config_dict(cfg: dict, where: str) -> tuple[dict, dict]:
    """A speculators config -> (the equivalent z-lab config, {draft_vocab_size, verifier})."""
    kind = cfg.get(KIND)
    if kind != "dflash":
        raise DFlashError(f"{where} is a speculators {kind!r} speculator, not a DFlash drafter "
                          "(speculators_model_type must be \"dflash\")")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DFlashError(f"{where}: speculators config lacks transformer_layer_config (the drafter's Qwen3 config)")
    if layer.get("model_type", "qwen3") != "qwen3":
        raise DFlashError(f"{where}: transformer_layer_config model_type {layer['model_type']!r} is not supported "
                          "(the DFlash drafter layers are Qwen3's)")
    if cfg.get("sample_from_anchor"):
        raise DFlashError(f"{where}: sample_from_anchor=true (the anchor slot drafts too, as DSpark) is not supported; "
                          "DFlash drafts from the mask slots only")
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not aux or not all(isinstance(i, int) for i in aux):
        raise DFlashError(f"{where}: aux_hidden_state_layer_ids must be a list of target layer ids")
    if min(aux) < 1:
        raise DFlashError(f"{where}: aux_hidden_state_layer_ids {aux} include 0 (the embedding output), "
                          "which DFlash drafters do not read")
    for k in ("block_size", "mask_token_id"):
        if cfg.get(k) is None:
            raise DFlashError(f"{where}: speculators config lacks {k!r}")
    z = {**QWEN3_DEFAULTS, **{k: cfg[k] for k in WINDOW_KEYS if k in cfg}, **layer}
    z.update(architectures=["DFlashDraftModel"], block_size=int(cfg["block_size"]),
             dflash_config={"target_layer_ids": [i - 1 for i in aux], "mask_token_id": int(cfg["mask_token_id"])})
    if cfg.get("sliding_window_non_causal"):  # sliding layers see the whole block, as full ones always do
        z["is_causal"] = False
    vocab = int(z["vocab_size"])
    n = int(cfg.get("draft_vocab_size") or vocab)
    if not 1 < n <= vocab:
        raise DFlashError(f"{where}: draft_vocab_size {n} must be in [2, vocab_size {vocab}]")
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return z, {"draft_vocab_size": n if n < vocab else None, "verifier": verifier}


def split_state(state: dict, config, where: str) -> tuple[dict, dict]:
    """Speculators tensors -> (the z-lab body, {"ids": target ids of the draft head or None,
    "head": its [N, H] LM head, "embed": the target's embedding copy or None})."""
    body = {k: v for k, v in state.items() if k not in (*BORROWED, *TRAINING_ONLY, "d2t", "t2d")}
    head = state.get("lm_head.weight")
    vocab, n = config.vocab_size, config.draft_vocab_size or config.vocab_size
    if head is None:
        raise DFlashError(f"{where}: speculators checkpoint lacks lm_head.weight (the drafter's LM head)")
    if tuple(head.shape) != (n, config.hidden_size):
        raise DFlashError(f"{where}: lm_head.weight has shape {list(head.shape)}, expected [{n}, {config.hidden_size}] "
                          "(draft_vocab_size x hidden_size)")
    ids = None
    if config.draft_vocab_size is not None:
        d2t = state.get("d2t")
        if d2t is None or tuple(d2t.shape) != (n,):
            raise DFlashError(f"{where}: draft_vocab_size {n} < vocab_size {vocab}, so the checkpoint needs d2t [{n}] "
                              f"(got {None if d2t is None else list(d2t.shape)})")
        ids = torch.arange(n) + d2t.long()  # target id = draft index + d2t[index]
        if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(set(ids.tolist())) != n:
            raise DFlashError(f"{where}: d2t maps draft ids outside [0, {vocab}) or twice: a corrupt vocabulary map")
        t2d = state.get("t2d")
        marked = None if t2d is None else t2d.bool().nonzero().flatten().tolist()
        if t2d is not None and (t2d.numel() != vocab or marked != sorted(ids.tolist())):
            raise DFlashError(f"{where}: t2d and d2t disagree on the draft vocabulary's target ids")
    return body, {"ids": ids, "head": head, "embed": state.get("embed_tokens.weight")}
