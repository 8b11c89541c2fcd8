"""What `export` and `quantize` are asked, declared once: `ExportOptions` (export's own options)
and `QuantRequest` (the quantization flags both commands take), each field also the command's
option (runtime/options.py `option`: named, documented and defaulted here and nowhere else).
`export_artifact` takes ExportOptions' fields as its keywords, with the same defaults.
Light: no torch, no onnx, so the command line reads them before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from ..runtime.errors import DFlashError
from ..runtime.options import option
from .quant_options import SCHEMES, QuantOptions, draft_only

MAX_CONTEXT = 2048  # export's --max-context when not given (export_artifact's default too)


@dataclass
class ExportOptions:
    dtype: str = option("fp32", "Weights and compute dtype; logits stay float32.", choices=("fp32", "fp16", "bf16"),
                        show_default=True)
    block_size: int | None = option(None, "Static block size K of draft_block.onnx [default: the drafter's].", type=int)
    max_context: int = option(MAX_CONTEXT, "Longest prompt + generation the runtime will allocate caches for.", type=int,
                              show_default=True)
    mask_token_id: int | None = option(None, "Override the drafter's dflash_config.mask_token_id.", type=int)
    opset: int | None = option(None, "ONNX opset [default: the exporter's].", type=int)
    draft_vocab: int | None = option(None, "Drafter head scores only N tokens (lossless: the target verifies every "
                                           "draft) [default: all].", type=int, metavar="N")
    draft_vocab_data: tuple = option((), "Token counts for --draft-vocab: train-draft shards (shard-*.pt or their "
                                         "directory), .jsonl ('tokens' or 'text') or text files; repeatable [default: "
                                         "the lowest ids].", multiple=True, type=click.Path(path_type=Path),
                                     metavar="FILE")
    attention: str = option("standard", "standard: plain ai.onnx ops (every provider, TensorRT); ort: the target's "
                                        "attention as ONNX Runtime's com.microsoft GroupQueryAttention over a cache "
                                        "updated in place (step cost flat in context; ONNX Runtime CPU/CUDA only).",
                            choices=("standard", "ort"), show_default=True)
    kv_cache: str | None = option(None, "With --attention ort: the target's K/V cache in int8 with static per-channel "
                                        "scales calibrated at export on text the target generates (a quarter of "
                                        "fp32's cache bytes: long-context decode reads less) [default: the model dtype].",
                                  choices=("int8",))
    kv_calibration: Path | None = option(None, "Prompts (one a line, tokenized with the target's tokenizer) the "
                                               "--kv-cache scales are calibrated on [default: a few seed prompts].",
                                         type=click.Path(path_type=Path, dir_okay=False), metavar="FILE")
    moe: str | None = option(None, "Mixture-of-experts targets only: how target.onnx runs the experts. op: ONNX "
                                   "Runtime's com.microsoft::MoE, one node per layer that runs only the selected "
                                   "experts (CPU, fp32, onnxruntime >= 1.23.1). standard: plain ai.onnx ops that "
                                   "gather each token's k experts (TensorRT, other providers, older ONNX Runtime) "
                                   "[default: op for fp32 where the installed onnxruntime has it, else standard].",
                             choices=("op", "standard"))
    force: bool = option(False, "Replace a non-empty --out directory (only once the export succeeded).", is_flag=True)
    room_check: bool = option(True, "Export even when free memory or disk look too small for the model (the OS may "
                                    "kill it).", opt="--no-room-check", is_flag=True, flag_value=False)
    progress: bool = option(True, "No progress display.", opt="--quiet", is_flag=True, flag_value=False)


@dataclass
class QuantRequest:
    """The weight-only quantization flags `export` and `quantize` share; `options()` is what they ask for."""

    quantize: str | None = option(None, "Weight-only quantization of the target's linear layers (ONNX Runtime "
                                        "MatMulNBits).", choices=tuple(SCHEMES))
    quant_block_size: int | None = option(None, "Weights per quantization block (along the input dimension); a power "
                                                "of two >= 16 [default: 128, halved until it divides the hidden size and "
                                                "a MoE target's expert width: 64 for gpt-oss].", type=int)
    quant_asymmetric: bool = option(False, "Asymmetric quantization (zero points); symmetric by default.", is_flag=True)
    quantize_draft: bool = option(False, "Also quantize the drafter's linear layers.", is_flag=True)
    draft_only: bool = option(False, "Quantize the drafter's graphs alone, their LM head included; the target stays as "
                                     "exported, so the output stays the float target's (acceptance may fall) "
                                     "[accuracy level default: 4].", is_flag=True)
    quantize_lm_head: bool = option(False, "Also quantize the LM head (one copy shared by target and drafter).",
                                    is_flag=True)
    quantize_embedding: bool = option(False, "Also quantize the embedding lookup (GatherBlockQuantized; tied "
                                             "embeddings: with --quantize-lm-head, one copy of the table serves both).",
                                      is_flag=True)
    quant_head_bits: str | None = option(None, "Bits of the quantized LM head and embedding lookup: 8 beside int4 "
                                               "layers keeps the vocabulary table, most of int4's error on a small "
                                               "model, at int8 [default: --quantize's].", choices=("4", "8"))
    quant_accuracy_level: str | None = option(None, "MatMulNBits accuracy_level: 0 = fp32 activations, 4 = int8 "
                                                    "activations (faster on CPU, more error); auto measures both on the "
                                                    "artifact (speed and logits vs float) [default: auto].",
                                              choices=("auto", "0", "1", "2", "3", "4"))

    def options(self) -> QuantOptions | None:
        """The QuantOptions asked for, or None; the sub-options alone are a mistake."""
        if self.quantize is not None:
            level = None if self.quant_accuracy_level in (None, "auto") else int(self.quant_accuracy_level)
            q = QuantOptions(self.quantize, self.quant_block_size, not self.quant_asymmetric, self.quantize_draft,
                             self.quantize_lm_head, level, self.quantize_embedding,
                             head_bits=int(self.quant_head_bits) if self.quant_head_bits else None)
            return draft_only(q) if self.draft_only else q
        if (self.quantize_draft or self.quantize_lm_head or self.quantize_embedding or self.quant_asymmetric
                or self.quant_accuracy_level is not None or self.draft_only or self.quant_head_bits):
            raise DFlashError("--quantize-draft, --draft-only, --quantize-lm-head, --quantize-embedding, "
                              "--quant-asymmetric, --quant-head-bits and --quant-accuracy-level need --quantize int4|int8")
        return None
