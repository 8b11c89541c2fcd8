"""MXFP4 expert weights, as gpt-oss's released checkpoints store them: dequantised on load.

Per 32 values one E8M0 scale byte (2^(s - 127)) and 16 bytes of FP4 (E2M1) codes, two per byte,
the low nibble first: `<name>_blocks` [E, rows, cols / 32, 16] uint8 and `<name>_scales`
[E, rows, cols / 32] uint8, rows being the output features (gate_up_proj: 2I, gate and up
interleaved; down_proj: H). So a dequantised tensor is [E, rows, cols], the layout ONNX
Runtime's MoE op reads, without the transpose transformers applies for its own [E, cols, rows].

Why not map to ONNX Runtime's QMoE directly: its 4-bit weights are integers with a linear
scale (and optional zero point) per block, while FP4 E2M1 codes are not evenly spaced
(0, 0.5, 1, 1.5, 2, 3, 4, 6) and the scales are powers of two; no per-block int4 code
reproduces them, so the mapping would not be exact. Dequantising is exact (every FP4 value
times a power of two is a float32, and a bfloat16 unless the exponent leaves its range).
Written by hand: a dozen lines of tensor indexing, and transformers' own converter returns the
transposed layout and wants its quantizer's environment.
"""

from __future__ import annotations

import torch

from ..runtime.errors import DFlashError

FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8 + scales [..., G] uint8 -> float32 [..., G * 32]."""
    lut = torch.tensor(FP4, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2).long()  # [..., G, 32], low nibble first
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def dequantize_experts(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """`state` with every `<name>_blocks` / `<name>_scales` pair replaced by `<name>` (float32,
    [E, rows, cols]: gpt-oss's experts in models/moe.py's layout); unquantized tensors pass."""
    for name in [k for k in state if k.endswith("_blocks")]:
        base = name[: -len("_blocks")]
        scales = state.pop(base + "_scales", None)
        if scales is None or tuple(state[name].shape[:-1]) != tuple(scales.shape) or state[name].shape[-1] != 16:
            raise DFlashError(f"{where}: MXFP4 tensor {name} {list(state[name].shape)} needs {base}_scales of shape "
                              f"{list(state[name].shape[:-1])} (16 bytes per block of 32)")
        state[base + ".mxfp4"] = dequantize(state.pop(name), scales)
    return state
