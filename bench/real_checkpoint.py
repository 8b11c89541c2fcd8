"""Random-weight bf16 checkpoints of released shapes, in the released layout, written without
holding them: Qwen3-8B (and a drafter of z-lab/Qwen3-8B-DFlash-b16's shape), Qwen3-30B-A3B cut
to N layers (and a drafter of the same form at its width).

    nice -n 10 .venv/bin/python bench/real_checkpoint.py qwen3-8b /work/ckpt
    nice -n 10 .venv/bin/python bench/real_checkpoint.py qwen3-30b-a3b /work/ckpt --layers 12

The demo's tokenizer files go beside the target (llama.cpp's converter needs a tokenizer; it pads
the vocabulary to the config's). Shards of at most 4 GB named model-0000i-of-0000n.safetensors with model.safetensors.index.json,
as Hugging Face writes them; each tensor's bytes are slices of one 64 MB pool of N(0, 0.02) bf16
values (at an offset from its name), norms are ones: what matters here is the shape and the
bytes' count, and the pool keeps writing at the disk's speed. Prints the directories.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np

SHARD = 4 * 10**9
POOL = None


def pool() -> np.ndarray:
    global POOL
    if POOL is None:
        x = (np.random.default_rng(0).standard_normal(32 << 20, dtype=np.float32) * 0.02).view(np.uint32)
        POOL = (x >> 16).astype(np.uint16)  # bf16 bits (truncated)
    return POOL


def tensor_bytes(key: str, shape: tuple[int, ...], f) -> None:
    """Write the tensor's bf16 bytes to f, chunk by chunk (norms: ones)."""
    n = int(np.prod(shape))
    if key.endswith("norm.weight"):
        f.write(np.full(n, 0x3F80, np.uint16).tobytes())
        return
    p = pool()
    at = zlib.crc32(key.encode()) % len(p)
    while n:
        take = min(n, len(p) - at)
        f.write(p[at:at + take].tobytes())
        n, at = n - take, 0


def write_checkpoint(d: Path, config: dict, tensors: list[tuple[str, tuple[int, ...]]]) -> None:
    """config.json + shards of at most SHARD bytes + the index, tensors in the given order."""
    d.mkdir(parents=True, exist_ok=True)
    shards, cur, size = [], [], 0
    for key, shape in tensors:
        nbytes = 2 * int(np.prod(shape))
        if cur and size + nbytes > SHARD:
            shards.append(cur)
            cur, size = [], 0
        cur.append((key, shape))
        size += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for i, group in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape in group:
            nbytes = 2 * int(np.prod(shape))
            header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[key] = name
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * ((-len(h)) % 8)
        with open(d / name, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h)
            for key, shape in group:
                tensor_bytes(key, shape, f)
        total += offset
    if len(shards) > 1:
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (d / "config.json").write_text(json.dumps(config, indent=2))


def layer_tensors(p: str, hidden: int, heads: int, kv: int, hd: int, inter: int | None, experts: int = 0,
                  moe_inter: int = 0) -> list:
    out = [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
           (p + "self_attn.q_proj.weight", (heads * hd, hidden)), (p + "self_attn.k_proj.weight", (kv * hd, hidden)),
           (p + "self_attn.v_proj.weight", (kv * hd, hidden)), (p + "self_attn.o_proj.weight", (hidden, heads * hd)),
           (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
    if experts:
        out.append((p + "mlp.gate.weight", (experts, hidden)))
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (moe_inter, hidden)), (q + "up_proj.weight", (moe_inter, hidden)),
                    (q + "down_proj.weight", (hidden, moe_inter))]
    else:
        out += [(p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter))]
    return out


def target(d: Path, config: dict) -> None:
    c = config
    hidden, hd = c["hidden_size"], c["head_dim"]
    tensors = [("model.embed_tokens.weight", (c["vocab_size"], hidden))]
    for i in range(c["num_hidden_layers"]):
        tensors += layer_tensors(f"model.layers.{i}.", hidden, c["num_attention_heads"], c["num_key_value_heads"], hd,
                                 c.get("intermediate_size"), c.get("num_experts", 0), c.get("moe_intermediate_size", 0))
    tensors += [("model.norm.weight", (hidden,)), ("lm_head.weight", (c["vocab_size"], hidden))]
    write_checkpoint(d, config, tensors)


def drafter(d: Path, config: dict, taps: int) -> None:
    """z-lab's DFlashDraftModel layout: fc over the taps, hidden_norm, layers, norm (no embedding or head)."""
    c = config
    hidden = c["hidden_size"]
    tensors = [("fc.weight", (hidden, taps * hidden)), ("hidden_norm.weight", (hidden,))]
    for i in range(c["num_hidden_layers"]):
        tensors += layer_tensors(f"layers.{i}.", hidden, c["num_attention_heads"], c["num_key_value_heads"],
                                 c["head_dim"], c["intermediate_size"])
    tensors.append(("norm.weight", (hidden,)))
    write_checkpoint(d, config, tensors)


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
DEMO = Path(__file__).resolve().parents[1] / "demo" / "pair" / "target"
B16 = Path("/work/shared/fixtures/drafter-configs/qwen3-8b-dflash-b16.config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=["qwen3-8b", "qwen3-30b-a3b"])
    ap.add_argument("root", type=Path)
    ap.add_argument("--layers", type=int, default=None, help="cut the target to this many layers")
    args = ap.parse_args()
    if args.shape == "qwen3-8b":
        t, dname = QWEN3_8B | ({"num_hidden_layers": args.layers} if args.layers else {}), "Qwen3-8B-DFlash-b16"
        dc = json.loads(B16.read_text()) | {"num_target_layers": t["num_hidden_layers"]}
        tdir = args.root / ("Qwen3-8B" if not args.layers else f"Qwen3-8B-{args.layers}L")
    else:
        t = QWEN3_30B_A3B | {"num_hidden_layers": args.layers or 12}
        tdir = args.root / f"Qwen3-30B-A3B-{t['num_hidden_layers']}L"
        dname = f"Qwen3-30B-A3B-{t['num_hidden_layers']}L-drafter"
        # no released drafter config at hand: b16's form (5 layers, block 16) at this width
        dc = json.loads(B16.read_text()) | {"hidden_size": 2048, "intermediate_size": 6144, "num_key_value_heads": 4,
                                            "num_target_layers": t["num_hidden_layers"]}
    if not (tdir / "config.json").is_file():
        target(tdir, t)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the demo's (4096 ids): llama.cpp's converter needs one
        if not (tdir / f).is_file():
            shutil.copy(DEMO / f, tdir / f)
    ddir = args.root / dname
    if not (ddir / "config.json").is_file():
        drafter(ddir, dc, taps=5)
    print(tdir)
    print(ddir)


if __name__ == "__main__":
    main()
