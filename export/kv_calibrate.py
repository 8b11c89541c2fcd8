"""Static per-channel scales for the ort flavour's int8 cache (`export --kv-cache int8`).

ONNX Runtime's GroupQueryAttention stores K (after rotary) and V as clamp(round(x * (1 / scale)))
with one fixed scale per cache channel (kv head x head dim, inputs k_scale / v_scale), so the
scales are chosen once, at export: the absolute maximum of each channel over text the target
itself generates greedily (from a few seed prompts, or the prompts of --kv-calibration),
read from the graph's own cache (K rotated, as stored), times MARGIN. No data set is needed:
the target's own text is what it will mostly attend to at run time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import
from ..runtime import contract as C
from ..runtime.files import prompt_lines, readable
from .save import read_initializers

onnx = lazy_import("onnx")
tokenizers = lazy_import("tokenizers")

# The calibration sees a few hundred positions; other text reaches larger values in some
# channels, and a clamped value costs far more than a coarser step. On the trained demo target
# (bench/kv_cache.py: 6 other prompts, 1248 positions, logits against the fp32 cache) the
# margin traded so: 1.0 clamped 1.3 % of the values (KL 1.5e-3), 1.25 0.27 % (3.3e-4), 1.5
# 0.07 % (7.6e-5), 2.0 0.005 % (1.5e-5), 3.0 none but a coarser step (3.3e-5), 4.0 (5.7e-5).
MARGIN = 2.0
SEEDS = ("The history of the city begins", "def fibonacci(n):", "Question: why is the sky blue?\nAnswer:",
         "Once upon a time")
NEW_TOKENS = 48


def seed_prompts(target_dir: Path, vocab_size: int, prompts_file: Path | None) -> tuple[list[list[int]], str]:
    """Token ids of the calibration prompts and where they came from: --kv-calibration's lines
    (needs the target's tokenizer.json), else SEEDS through the tokenizer, else (no tokenizer:
    test models) fixed pseudo-random ids."""
    tok_path = Path(target_dir) / "tokenizer.json"
    if prompts_file is not None:
        lines = prompt_lines(prompts_file, "--kv-calibration ")
        if not tok_path.is_file():
            raise DFlashError(f"--kv-calibration needs the target's tokenizer.json, which {target_dir} lacks")
    if tok_path.is_file():
        tok = tokenizers.Tokenizer.from_file(str(readable(tok_path)))
        texts = lines if prompts_file is not None else SEEDS
        ids = [[i for i in tok.encode(t).ids if i < vocab_size] for t in texts]
        if all(ids):
            return ids, str(prompts_file) if prompts_file is not None else "seed prompts"
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (8,), generator=g).tolist() for _ in SEEDS], "random token ids"


@torch.no_grad()
def calibrate(graph, prompts: list[list[int]], max_context: int, new_tokens: int = NEW_TOKENS,
              margin: float = MARGIN) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_scale, v_scale) float32 [Hkv, 1, D]: `graph` (export/graphs.py TargetOrtGraph
    with a float cache) prefills each prompt and generates `new_tokens` greedily; each channel's
    absolute maximum over every cached position of every prompt, times `margin`, / 127."""
    t = graph.target
    a, dtype = t.model.layers[0].self_attn, t.model.embed_tokens.weight.dtype
    n = len(t.model.layers)
    amax = [torch.zeros(a.hkv, 1, a.d) for _ in range(2 * n)]
    for ids in prompts:
        ids = ids[: max(1, max_context - new_tokens - 1)]
        rows = len(ids) + new_tokens + 1  # (GQA's eager reference writes rows [0, total) of any buffer)
        cache = [torch.zeros(1, a.hkv, rows, a.d, dtype=dtype) for _ in range(2 * n)]
        x, length = torch.tensor([ids]), 0
        for _ in range(new_tokens + 1):
            s = x.shape[1]
            pos = torch.arange(length, length + s)[None]
            out = graph.run(x, pos, torch.tensor([length + s - 1], dtype=torch.int32),
                            torch.tensor(length + s, dtype=torch.int32), None, cache)
            cache, length = list(out[3:]), length + s
            x = out[1][:, -1:]
        for i, c in enumerate(cache):
            amax[i] = torch.maximum(amax[i], c[0, :, :length].float().abs().amax(1, keepdim=True))
    scales = []
    for m in amax:  # a channel never seen non-zero keeps a small step rather than a zero scale
        m = torch.maximum(m, m.max().clamp_min(1e-6) * 1e-3)
        scales.append(m * margin / 127)
    return [(scales[2 * i], scales[2 * i + 1]) for i in range(n)]


def read_scales(root: Path) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The per-layer (k_scale, v_scale) an export's target.onnx holds (GroupQueryAttention inputs
    12 and 13, in layer order); None when its cache is not quantized. What `check` builds its
    PyTorch reference with."""
    model = onnx.load(str(Path(root) / C.GRAPH_FILES[C.TARGET]), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention" and len(n.input) > 13 and n.input[12]]
    if not nodes:
        return None
    arrays = read_initializers(Path(root), model, {i for n in nodes for i in n.input[12:14]})
    return [tuple(torch.from_numpy(arrays[i].copy()) for i in n.input[12:14]) for n in nodes]
