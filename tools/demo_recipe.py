"""Recipe for the shipped demo pair: rebuilds demo/pair/{target,draft} from scratch on CPU.

    python tools/demo_recipe.py target --minutes 24 --snapshots 8 12 16   # tokenizer + target (snapshots)
    python tools/demo_recipe.py pair-target demo/work/target-16.0min      # the target we ship
    python tools/demo_recipe.py prompts                                   # training + held-out prompts
    python tools/demo_recipe.py draft --minutes 25                        # `dflash-export train-draft`
    python tools/demo_recipe.py draft --minutes 38 --resume --gen-minutes 3 --eval-every 0  # 2nd run
    python tools/demo_recipe.py draft --minutes 55 --resume --gen-minutes 3 --eval-every 0  # 3rd run (shipped)

Extra options after `draft` go to train-draft (they override DRAFT_OPTIONS below).
Budget and measured results: demo/RESULTS.md.

The corpus exists offline wherever Python does: the standard library's own source files
(test/ dirs and site-packages excluded). Every 12th file (sorted by path) is held out:
held-out loss and the evaluation prompts (demo/prompts.jsonl) come only from those.
Scratch files go to demo/work/ (gitignored); the pair is written to demo/pair/.
Set OMP_WAIT_POLICY=PASSIVE on shared CPUs (done below when unset).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from dflash_export.models import Target, TargetConfig  # noqa: E402
from dflash_export.runtime.lazy import lazy_import  # noqa: E402

transformers = lazy_import("transformers")  # optional: without it the config is written by hand (target_config_dict)

HERE = Path(__file__).resolve().parents[1] / "demo"  # the shipped demo data (this script lives in tools/)
WORK = HERE / "work"
PAIR = HERE / "pair"
PROMPTS = HERE / "prompts.jsonl"
HOLDOUT_EVERY = 12
SPECIALS = ["<|endoftext|>", "<|mask|>"]

# The target: a small Qwen3 (tied embeddings). Sized so that CPU training in ~20 min gives
# a model that writes plausible Python and whose greedy continuations are predictable.
TARGET = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files of the running Python's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        parts = Path(dirpath).relative_to(root).parts
        if any(p in ("test", "tests", "idle_test", "site-packages", "__pycache__") for p in parts):
            dirnames[:] = []
            continue
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    files.sort()
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    return train, held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# -- tokenizer -------------------------------------------------------------------------


def make_tokenizer(out: Path, train: list[Path], vocab: int) -> None:
    """Byte-level BPE with <|endoftext|> (id 0) and a dedicated <|mask|> (id 1) for DFlash."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in train), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


def encode_files(tokenizer_dir: Path, files: list[Path]):
    """One token stream: every file followed by <|endoftext|>."""
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch([read(f) for f in files]):
        ids += enc.ids + [eos]
    return np.array(ids, dtype=np.int16)


# -- target ----------------------------------------------------------------------------


def target_config_dict(tokenizer_dir: Path) -> dict:
    """An HF Qwen3ForCausalLM config.json (transformers' own when installed)."""
    eos = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id("<|endoftext|>")
    kw = dict(TARGET, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    try:
        cfg = transformers.Qwen3Config(**kw).to_dict()
    except ImportError:
        cfg = dict(kw, model_type="qwen3", use_sliding_window=False, sliding_window=None)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    return cfg


def save_target(model, cfg: dict, tokenizer_dir: Path, out: Path) -> None:
    """HF layout, bf16 safetensors (tied lm_head omitted, as transformers writes it)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"], "do_sample": False}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)


def train_target(args) -> None:
    """Causal-LM training of models.Target with bf16 autocast; snapshots along the way."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, held = corpus_files()
    tokdir = WORK / "tokenizer"
    if not (tokdir / "tokenizer.json").is_file():
        t0 = time.time()
        make_tokenizer(tokdir, train, TARGET["vocab_size"])
        print(f"tokenizer: {time.time() - t0:.1f}s", flush=True)
    stream = encode_files(tokdir, train).astype(np.int64)
    held_stream = encode_files(tokdir, held).astype(np.int64)
    print(f"corpus: {len(train)} train files {len(stream)} tokens, {len(held)} held-out files {len(held_stream)} tokens",
          flush=True)
    cfg = target_config_dict(tokdir)
    model = Target(TargetConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * TARGET["num_hidden_layers"]) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.normal_(0.0, std)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params / 1e6:.2f}M params", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    s = args.seq
    past = model.empty_kv(args.batch)
    pos = torch.arange(s)[None].expand(args.batch, s)
    eval_starts = np.random.default_rng(1).integers(0, len(held_stream) - s - 1, 64)
    eval_x = torch.from_numpy(np.stack([held_stream[i : i + s + 1] for i in eval_starts]))

    def held_loss() -> float:
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses = []
            for i in range(0, 64, args.batch):
                x = eval_x[i : i + args.batch]
                logits, _, _ = model(x[:, :-1], pos[: len(x)], model.empty_kv(len(x)))
                losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item())
        model.train()
        return float(np.mean(losses))

    budget = args.minutes * 60
    snaps = sorted(args.snapshots)
    t0, step, tokens, log = time.time(), 0, 0, []
    model.train()
    while True:
        elapsed = time.time() - t0
        frac = elapsed / budget
        if frac >= 1:
            break
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(stream) - s - 1, args.batch)
        x = torch.from_numpy(np.stack([stream[i : i + s + 1] for i in starts]))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, _, _ = model(x[:, :-1], pos, past)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, :-1].numel()
        if step % 50 == 0:
            el = time.time() - t0
            print(f"step {step} {el / 60:.1f}min loss {loss.item():.3f} lr {lr:.2e} {tokens / el:.0f} tok/s", flush=True)
        if snaps and elapsed >= snaps[0] * 60:
            m = snaps.pop(0)
            hl = held_loss()
            log.append({"minutes": m, "step": step, "tokens": tokens, "held_out_loss": hl})
            print(f"snapshot {m} min: held-out loss {hl:.3f}", flush=True)
            save_target(model, cfg, tokdir, WORK / f"target-{m}min")
            (WORK / f"target-{m}min-trainlog.json").write_text(json.dumps({"params": n_params, "log": log}, indent=2))
    hl = held_loss()
    el = time.time() - t0
    log.append({"minutes": round(el / 60, 1), "step": step, "tokens": tokens, "held_out_loss": hl})
    print(f"final: {step} steps {tokens} tokens {el / 60:.1f} min, held-out loss {hl:.3f}", flush=True)
    out = Path(args.out) if args.out else WORK / "target"
    save_target(model, cfg, tokdir, out)
    (out.parent / f"{out.name}-trainlog.json").write_text(json.dumps(
        {"params": n_params, "config": TARGET, "seq": s, "batch": args.batch, "lr": args.lr, "log": log}, indent=2))


# -- prompts ---------------------------------------------------------------------------


def chunks(text: str, rng: random.Random, n: int, min_chars: int = 200, max_chars: int = 600) -> list[str]:
    """n code snippets that start and end on line boundaries."""
    lines = text.splitlines(keepends=True)
    out = []
    for _ in range(n * 4):
        if len(out) >= n or len(lines) < 8:
            break
        i = rng.randrange(len(lines))
        j, size = i, 0
        while j < len(lines) and size < rng.randint(min_chars, max_chars):
            size += len(lines[j])
            j += 1
        snippet = "".join(lines[i:j])
        if len(snippet) >= min_chars and snippet.strip():
            out.append(snippet)
    return out


def write_prompts(path: Path, files: list[Path], per_file: int, total: int, seed: int) -> int:
    rng = random.Random(seed)
    rows = []
    files = list(files)
    rng.shuffle(files)
    for f in files:
        rows += [{"prompt": c, "source": f.name} for c in chunks(read(f), rng, per_file)]
        if len(rows) >= total:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:total]))
    return min(total, len(rows))


def prompts(args) -> None:
    """Training prompts from train files (demo/work), held-out eval prompts (demo/prompts.jsonl)."""
    train, held = corpus_files()
    n = write_prompts(WORK / "train_prompts.jsonl", train, per_file=args.per_file, total=args.train_prompts, seed=args.seed)
    m = write_prompts(PROMPTS, held, per_file=1, total=args.eval_prompts, seed=args.seed + 1)
    print(f"prompts: {n} training (demo/work/train_prompts.jsonl), {m} held-out ({PROMPTS.relative_to(HERE.parent)})")


# -- drafter ---------------------------------------------------------------------------


# The options the shipped drafter was trained with (see demo/RESULTS.md).
DRAFT_OPTIONS = ["--block-size", "16", "--layers", "1", "--target-layer-ids", "1,2,3,4", "--gamma", "7",
                 "--lr", "2e-3", "--train-batch", "8", "--anchors", "48", "--sequences", "8000", "--gen-minutes", "12",
                 "--gen-tokens", "160", "--gen-batch", "64", "--eval-every", "150", "--eval-n", "8",
                 "--eval-tokens", "128", "--torch-threads", "2", "--seed", "0"]


def pair_target(args) -> None:
    """Ship a trained target (a snapshot or the final one) as demo/pair/target."""
    src = Path(args.source)
    dst = PAIR / "target"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    print(f"{src} -> {dst}")


def draft(args) -> None:
    """The drafter, through the project's own `dflash-export train-draft`."""
    target = Path(args.target) if args.target else PAIR / "target"
    cmd = [sys.executable, "-c", "from dflash_export.cli import main; main()", "train-draft", "--target", str(target),
           "--out", str(PAIR / "draft"), "--data", str(WORK / "train_prompts.jsonl"),
           "--eval-prompts", str(PROMPTS), "--work", str(WORK / "draft"), "--minutes", str(args.minutes),
           *DRAFT_OPTIONS, *args.extra]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    t = sub.add_parser("target")
    t.add_argument("--minutes", type=float, default=20)
    t.add_argument("--snapshots", type=float, nargs="*", default=[10])
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None, help="default demo/work/target")
    q = sub.add_parser("prompts")
    q.add_argument("--train-prompts", type=int, default=8000)
    q.add_argument("--per-file", type=int, default=16)
    q.add_argument("--eval-prompts", type=int, default=24)
    q.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("pair-target")
    c.add_argument("source", help="e.g. demo/work/target-16.0min")
    d = sub.add_parser("draft")
    d.add_argument("--target", default=None)
    d.add_argument("--minutes", type=float, default=25)
    args, extra = p.parse_known_args()  # unknown options go to train-draft (draft stage only)
    if extra and args.stage != "draft":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    {"target": train_target, "prompts": prompts, "pair-target": pair_target, "draft": draft}[args.stage](args)


if __name__ == "__main__":
    main()
