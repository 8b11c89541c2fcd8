"""A DFlash 2 pair briefly trained for the sampling tests (tests/test_dflash2_sampling.py) and
the long acceptance run (bench/dflash2.py --acceptance).

The target: a tiny random Qwen3 with a small vocabulary and a peaked distribution (weights at a
larger spread than the default tiny models), so its samples have structure to learn. The
drafter: the official z-lab `DFlash2DraftModel` (the `dflash` package), fitted for a few hundred
Adam steps to the target's own samples at the decoding temperature, with the official forward
(`model(target_hidden=, noise_embedding=, position_ids=)`, `compute_logits`): cross-entropy of
each masked position on the logits, plus on the walk's scores over the whole vocabulary given the
true previous token (teacher forcing), so the selector's pair terms learn too. Saved in the
released layout (codebooks without `.weight`). Deterministic for a seed on one thread.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_export.models import TargetConfig, draft_config_dict
from dflash_export.models.tiny import hf_model, make_target

V, BLOCK, MASK, TEMP = 12, 4, 10, 0.8


def drafter_config(tc: TargetConfig) -> dict:
    cfg = draft_config_dict(tc, num_layers=1, block_size=BLOCK, target_layer_ids=[0, 1], mask_token_id=MASK,
                            layer_types=["sliding_attention"], sliding_window=64)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(block_size=BLOCK, conv_kernel_size=2, conv_group_size=8, selector_rank=8,
                                selector_top_k=6, output_multiplier=1.0, final_logit_softcapping=None)
    return cfg


@torch.no_grad()
def target_samples(hf, n: int, length: int, seed: int) -> torch.Tensor:
    """[n, length] plain samples of the target at TEMP from random 3-token prompts."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, V, (n, 3), generator=g)
    while seqs.shape[1] < length:
        logits = hf(seqs, use_cache=False).logits[:, -1].float() / TEMP
        seqs = torch.cat([seqs, torch.multinomial(torch.softmax(logits, -1), 1, generator=g)], 1)
    return seqs


def train_pair(root: Path, steps: int = 300, seed: int = 0):
    """-> (target dir, drafter dir, official drafter, HF target), trained and saved under root."""
    import transformers
    from dflash import model as dm
    from safetensors.torch import save_file

    tdir = make_target(root / "t", "qwen3", seed=seed + 11, vocab=V, hidden=32, layers=2, heads=4, kv_heads=2,
                       head_dim=8, intermediate=48, std=0.3)
    hf = hf_model(tdir)
    raw = drafter_config(TargetConfig.load(tdir))
    torch.manual_seed(seed)
    model = dm.DFlash2DraftModel(transformers.Qwen3Config(**raw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.zero_()
                p[:, 0] = 1.0  # identity convolutions to start from
            elif p.dim() > 1:
                p.normal_(0.0, 0.05)
    seqs = target_samples(hf, 192, 24, seed)
    with torch.no_grad():
        hs = hf(seqs, output_hidden_states=True, use_cache=False).hidden_states
    taps = dm.extract_context_feature(hs, [0, 1])
    emb_w, head = hf.get_input_embeddings().weight, hf.lm_head
    sel = model.candidate_selector
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(0, seqs.shape[0], (32,), generator=g)
        a = int(torch.randint(3, seqs.shape[1] - BLOCK + 1, (1,), generator=g))  # the anchor's position
        block = torch.full((32, BLOCK), MASK)
        block[:, 0] = seqs[rows, a]
        labels = seqs[rows, a + 1 : a + BLOCK]
        h = model(target_hidden=taps[rows, :a], noise_embedding=torch.nn.functional.embedding(block, emb_w),
                  position_ids=torch.arange(a + BLOCK)[None].expand(32, -1))[:, 1:]
        logits = model.compute_logits(h, head)
        prev = seqs[rows, a : a + BLOCK - 1]  # the true previous token of each drafted position
        pair = torch.einsum("bnr,vr->bnv", sel.predecessor_codebook(prev) * sel.hidden_projection(h),
                            sel.successor_codebook.weight)
        loss = sum(torch.nn.functional.cross_entropy((x / TEMP).flatten(0, 1), labels.flatten())
                   for x in (logits, logits + pair))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    ddir = root / "d"
    ddir.mkdir(parents=True)
    (ddir / "config.json").write_text(json.dumps(raw))
    state = {k.removesuffix(".weight") if "codebook" in k else k: v.detach().contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(ddir / "model.safetensors"))
    return tdir, ddir, model, hf


def trained_export() -> Path:
    """The trained pair and its export (max context 128) in the tests' artifact cache, keyed by
    the exporter's source and this file: `t` the target, `d` the drafter, `out` the export."""
    from runtime_cases import cached

    from dflash_export.export.artifact import export_artifact

    def build(tmp: Path) -> None:
        torch.set_num_threads(1)
        train_pair(tmp)
        export_artifact(tmp / "t", tmp / "d", tmp / "out", max_context=128, progress=False)
    return cached("dflash2-trained", Path(__file__).read_text(), build)
