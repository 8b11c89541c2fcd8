"""What `--quantize` and `--kv-cache` ask for, and the checks on them that need nothing loaded.

Kept apart from export/quantize.py (which imports onnx and ONNX Runtime's quantizer) so that the
command line refuses a bad combination, and computes the default block size, before any heavy import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from ..runtime.errors import DFlashError
from ..runtime import contract as C

SCHEMES = {"int4": 4, "int8": 8}
DEFAULT_BLOCK = {"int4": 128, "int8": 128}  # weights per block when --quant-block-size is not given
DRAFT_ONLY_LEVEL = 4  # --draft-only's level: the output cannot change, and level 0 is int8's slow path on CPU
ROUTERS = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")  # MoE routing weights: kept in the export dtype
EXPERT_FORMS = {  # the manifest's quantization.experts, by the target's MoE graph form (export/moe.py)
    "op": "com.microsoft::QMoE",
    "standard": "gathered codes dequantized in standard ops (Gather, Cast, Sub, Mul)",
}


@dataclass
class QuantOptions:
    """What `export --quantize` asked for; `record()` is the manifest's `quantization`."""

    scheme: str  # "int4" | "int8"
    block_size: int | None = None  # None: default_block_size for the artifact (quantize_artifact)
    symmetric: bool = True
    draft: bool = False  # also the drafter's linear layers (draft_context, draft_block)
    lm_head: bool = False  # also the LM head (shared by target and draft_block)
    accuracy_level: int | None = None  # MatMulNBits' compute type on CPU (None: measured, export/accuracy_level.py)
    embedding: bool = False  # also the embedding lookup (GatherBlockQuantized)
    target: bool = True  # False (--draft-only): the drafter's graphs alone, their LM head included; target.onnx untouched
    head_bits: int | None = None  # bits of the LM head and the lookup (None: the scheme's): 8 beside int4 layers

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    def head(self) -> "QuantOptions":
        """The options the LM head and the embedding lookup are quantized with (--quant-head-bits)."""
        if self.head_bits is None or self.head_bits == self.bits:
            return self
        return dataclasses.replace(self, scheme=next(k for k, b in SCHEMES.items() if b == self.head_bits))

    def graphs(self) -> tuple[str, ...]:
        """Graphs whose linear layers are quantized (the shared LM head goes with `lm_head`)."""
        drafter = (C.DRAFT_CONTEXT, C.DRAFT_BLOCK) if self.draft else ()
        return ((C.TARGET,) if self.target else ()) + drafter

    def quantizes(self, graph: str, weight: str) -> bool:
        if weight.endswith(ROUTERS):  # an MoE router: a rounded logit would choose other experts
            return False
        if weight in C.SHARED_INITIALIZERS:  # the head: in both graphs or in neither, so it stays one copy,
            return self.lm_head and (self.target or graph != C.TARGET)  # but --draft-only gives the drafter its own
        return graph in self.graphs()

    def record(self, weights: dict[str, list[str]], level: dict, moe_path: str | None = None) -> dict:
        """level: {"accuracy_level", "accuracy_level_from" ("flag" | "measured"), "accuracy_probe"};
        moe_path: the target's MoE graph form, which says the quantized experts' (`experts`)."""
        d = asdict(self)
        d.update(method="onnxruntime MatMulNBitsQuantizer (RTN, blockwise)", bits=self.bits, weights=weights, **level)
        if moe_path is not None and self.target:
            d["experts"] = EXPERT_FORMS[moe_path]
        return d


def check_options(q: QuantOptions, dtype: str) -> None:
    """Refuse what cannot work, before anything is loaded."""
    if q.scheme not in SCHEMES:
        raise DFlashError(f"--quantize {q.scheme} is not supported; choose int4 or int8 (weight-only, ONNX Runtime MatMulNBits)")
    if dtype == "bf16":
        raise DFlashError("--quantize with --dtype bf16 is not supported (ONNX Runtime's CPU MatMulNBits has no bf16 "
                          "kernel); export with --dtype fp32 or fp16")
    if q.block_size is not None and (q.block_size < 16 or q.block_size & (q.block_size - 1)):
        raise DFlashError(f"--quant-block-size {q.block_size}: MatMulNBits takes a power of two >= 16 (e.g. 32, 64, 128)")
    if q.accuracy_level not in (None, 0, 1, 2, 3, 4):
        raise DFlashError(f"--quant-accuracy-level {q.accuracy_level}: MatMulNBits takes 0-4")
    if q.head_bits is not None and q.head_bits not in SCHEMES.values():
        raise DFlashError(f"--quant-head-bits {q.head_bits}: choose 4 or 8")
    if q.head_bits is not None and not (q.lm_head or q.embedding):
        raise DFlashError("--quant-head-bits needs --quantize-lm-head or --quantize-embedding (the head and lookup are "
                          "otherwise left in the export dtype)")
    if not q.target and q.embedding:
        raise DFlashError("--draft-only with --quantize-embedding: the lookup table is the target's; "
                          "--draft-only quantizes the drafter's linear layers and LM head alone")


def draft_only(q: QuantOptions) -> QuantOptions:
    """--draft-only: the drafter's graphs, their LM head included, and nothing of the target.
    The drafter only proposes tokens the float target verifies, so greedy output stays the
    float target's own; rounding can only lower acceptance."""
    return dataclasses.replace(q, draft=True, lm_head=True, target=False)


def default_block_size(scheme: str, hidden: int, expert_size: int | None = None) -> int:
    """The block size when none was asked for: DEFAULT_BLOCK[scheme], halved (down to 16) until it
    divides the hidden size, as the embedding lookup's blocks must, and an MoE target's expert
    width, as QMoE's and the gathered experts' blocks must (gpt-oss's 2880: 64)."""
    block = DEFAULT_BLOCK[scheme]
    while block > 16 and (hidden % block or (expert_size or 0) % block):
        block //= 2
    return block


KV_CACHE_TYPES = ("int8",)  # export --kv-cache (beside the default: the model dtype)


def check_kv_cache(kv_cache: str | None, attention: str, calibration) -> None:
    """Refuse a quantized cache where ONNX Runtime's GroupQueryAttention does not keep the cache."""
    if kv_cache is None:
        if calibration is not None:
            raise DFlashError("--kv-calibration needs --kv-cache int8")
        return
    if kv_cache not in KV_CACHE_TYPES:
        raise DFlashError(f"--kv-cache must be one of {', '.join(KV_CACHE_TYPES)} (got {kv_cache!r})")
    if attention != "ort":
        raise DFlashError(f"--kv-cache {kv_cache} needs --attention ort (ONNX Runtime's GroupQueryAttention keeps the "
                          "quantized cache; the standard flavour's cache is in the model dtype)")
