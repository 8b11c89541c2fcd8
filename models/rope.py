"""Rotary position embeddings as the checkpoints state them: `rope_theta` with `rope_scaling`
(transformers 4) or `rope_parameters` (5), and the frequencies each scaling kind gives, computed
as transformers computes them so the exported graphs agree with the reference to the bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import

torch = lazy_import("torch")  # only for inv_freq: the configs themselves are read without torch


@dataclass
class Rope:
    theta: float
    kind: str = "default"  # default | linear | llama3 | yarn | proportional
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # yarn: cos and sin times this (so scores times its square), as transformers
    partial: float = 1.0  # proportional: the fraction of head_dim that rotates (the rest has frequency 0)

    def inv_freq(self, head_dim: int) -> list[float]:
        """Per-pair rotation frequencies, scaled as transformers' rope init functions do."""
        if self.kind == "proportional":  # Gemma 4's full layers: exponents over the whole head_dim
            angles = int(self.partial * head_dim // 2)
            inv = 1.0 / (self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
            return torch.cat([inv, torch.zeros(head_dim // 2 - angles)]) / self.factor
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "yarn":
            inv = _yarn(self, head_dim)
        elif self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = torch.where(medium, smoothed, scaled)
        return inv


def _yarn(r: Rope, dim: int):
    """YaRN (arXiv 2309.00071): frequencies below the ramp interpolated by `factor`, above it
    kept, a linear blend between; the ramp's ends from beta_fast / beta_slow rotations.
    Written in transformers' operation order, so the frequencies agree to the bit."""
    def at(rotations: float) -> float:
        return dim * math.log(r.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = at(r.beta_fast), at(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = r.theta ** (torch.arange(0, dim, 2).float() / dim)
    return 1.0 / (r.factor * pos) * (1 - keep) + 1.0 / pos * keep


ROPE_KINDS = ("default", "linear", "llama3", "yarn", "proportional")


def parse_rope(cfg: dict, where: str) -> Rope:
    """RoPE from `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters` (5)."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and params and "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        raise DFlashError(f"{where}: per-layer-type rope_parameters are not supported")
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise DFlashError(f"{where}: rope_parameters / rope_scaling must be JSON objects")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ROPE_KINDS:
        raise DFlashError(f"{where}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")
    factor = float(merged.get("factor", 1.0) or 1.0)
    original = int(merged.get("original_max_position_embeddings", 8192))
    attention = 1.0
    if kind == "yarn":
        if merged.get("factor") is None:  # as transformers: the context extension the config states
            factor = float(cfg.get("max_position_embeddings", original)) / original
        attention = merged.get("attention_factor")
        if attention is None:
            mscale, mscale_all = merged.get("mscale"), merged.get("mscale_all_dim")
            attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)
    return Rope(
        theta=float(theta),
        kind=kind,
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=float(attention),
        partial=float(merged.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0,
    )


def _mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
