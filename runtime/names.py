"""Per-layer tensor names of one export, built once per backend from the contract's templates.

The runtime binds tensors by name on every call, and formatting a name costs ~1.7 us: a backend
(and `check`) builds this table at load and indexes it by layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .contract import CTX_KV, LINEAR_NEW, LINEAR_STATE, NEW_KV, PAST_CTX_KV, PAST_KV, PRESENT_KV


@dataclass(frozen=True)
class Names:
    """Every per-layer tensor name of one export, indexed by layer: built once per backend (and
    per check), since the runtime binds by name on every call (~1.7 us to format one)."""

    past_key: tuple[str, ...]
    past_value: tuple[str, ...]
    new_key: tuple[str, ...]
    new_value: tuple[str, ...]
    present_key: tuple[str, ...]  # ort flavour: bound to the same buffer as past_key
    present_value: tuple[str, ...]
    conv_state: tuple[str, ...]  # hybrid targets' linear-attention layers (unused names elsewhere)
    rec_state: tuple[str, ...]
    new_conv: tuple[str, ...]
    delta: tuple[tuple[str, str, str], ...]  # delta_k, delta_u, delta_g: what `commit_state` reads
    ctx_key: tuple[str, ...]  # drafter layers from here on
    ctx_value: tuple[str, ...]
    past_ctx_key: tuple[str, ...]
    past_ctx_value: tuple[str, ...]


def layer_names(target_layers: int, draft_layers: int = 0) -> Names:
    """The name table for `target_layers` target and `draft_layers` drafter layers."""
    t, d = range(target_layers), range(draft_layers)
    return Names(
        *(tuple(x.at(i).name for i in t) for x in (*PAST_KV, *NEW_KV, *PRESENT_KV, *LINEAR_STATE, LINEAR_NEW[0])),
        tuple(tuple(x.at(i).name for x in LINEAR_NEW[1:]) for i in t),
        *(tuple(x.at(j).name for j in d) for x in (*CTX_KV, *PAST_CTX_KV)),
    )


def names_of(m) -> Names:
    """`layer_names` for a manifest (anything with target_layers and draft_layers)."""
    return layer_names(m.target_layers, m.draft_layers)
