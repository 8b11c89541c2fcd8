"""A tiny converter from a z-lab drafter directory to the speculators format, for the tests.

Named as vllm-project/speculators' DFlashConverter writes it (convert/dflash/converter.py,
models/dflash/config.py, model.py's DraftVocabMixin): the z-lab config minus its DFlash keys
becomes `transformer_layer_config`; `aux_hidden_state_layer_ids` are the z-lab taps + 1; the
body's tensors keep their names; `embed_tokens.weight` and `lm_head.weight` are the target's
(the head's rows of the draft vocabulary only, when there is one, with `d2t` offsets and the
`t2d` mask, as speculators' build_vocab_mappings_from_distribution writes them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from dflash_export.models.draft_config import DraftConfig

NON_TRANSFORMER_KEYS = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"}


def target_tensors(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, LM head) of a target checkpoint (tied: the embedding twice)."""
    state = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        state.update(load_file(f))
    embed = state["model.embed_tokens.weight"]
    return embed, state.get("lm_head.weight", embed)


def to_speculators(zlab_dir: Path, target_dir: Path, out: Path, ids=None, drop_defaults: bool = True,
                   verifier: str = "acme/tiny", config_only: bool = False) -> Path:
    """Write `zlab_dir`'s drafter in the speculators format to `out`. ids: the draft vocabulary
    (sorted target ids) or None for all of it. drop_defaults: leave out of
    transformer_layer_config the keys equal to transformers' Qwen3Config defaults."""
    cfg = json.loads((Path(zlab_dir) / "config.json").read_text())
    dc = DraftConfig.from_dict(cfg)
    layer = {k: v for k, v in cfg.items() if k not in NON_TRANSFORMER_KEYS}
    if drop_defaults:
        defaults = transformers.Qwen3Config().to_dict()
        layer = {k: v for k, v in layer.items() if k not in defaults or defaults[k] != v}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = int(cfg["vocab_size"])
    n = vocab if ids is None else len(ids)
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": n,
        "block_size": dc.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in dc.target_layer_ids],
        "mask_token_id": dc.mask_token_id,
        "target_hidden_size": None,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": dc.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if config_only:
        return out
    state = load_file(Path(zlab_dir) / "model.safetensors")
    embed, head = target_tensors(target_dir)
    state["embed_tokens.weight"] = embed.clone()
    if ids is None:
        state["lm_head.weight"] = head.clone()
    else:
        ids = torch.as_tensor(ids, dtype=torch.long)
        state["lm_head.weight"] = head[ids].clone()
        state["d2t"] = ids - torch.arange(n)  # target id = draft index + d2t[index]
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
