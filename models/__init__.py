"""PyTorch reference modules (the export source) and the oracle generator."""

from .config import TargetConfig
from .draft_config import DraftConfig, default_target_layer_ids
from .drafter import Drafter, draft_config_dict, new_drafter
from .generate import Generation, autoregressive_generate, speculative_generate
from .kvcache import KVCache
from .target import Target

__all__ = [
    "DraftConfig", "TargetConfig", "default_target_layer_ids", "Drafter", "draft_config_dict", "new_drafter",
    "Generation", "KVCache", "autoregressive_generate", "speculative_generate", "Target",
]
