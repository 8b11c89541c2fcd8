"""The DFlash 2 drafter (z-lab `DFlash2DraftModel` format): DFlash 1 plus three things.

- Per layer, a grouped dynamic causal convolution around attention (`attention_conv`) and
  around the MLP (`mlp_conv`). `prepare` predicts, from the sublayer's input, per-token
  kernel deltas (one per group of `conv_group_size` channels, for both convolutions at
  once) and convolves the input along the block with `base_kernel[0] + delta_in`; `finish`
  convolves the sublayer's output with `base_kernel[1] + delta_out`. Causal: tap t reads
  position i - t, zero before the block's start. Only block positions pass through them:
  the context K/V (`context_kv`) are DFlash 1's, so the context cache is unchanged.
- Logits: the target's head, times `output_multiplier`, then `cap * tanh(x / cap)`.
- The candidate selector: the top-k logits of each draft position are unary scores; the
  walk starts from the anchor and takes, position by position, the candidate c that
  maximises `unary[c] + <pred_code[prev] * proj(h), succ_code[c]>` (greedy), or draws it
  from softmax(scores / T) (`sample_walk`; its q is the draft distribution).

The config is DFlash 1's (`DraftConfig`) plus the fields below; parsing stays strict.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from ..runtime.errors import DFlashError
from .config import DRAFT2_ARCH, DRAFT_ARCH, read_config
from .draft_config import DraftConfig
from .drafter import Drafter, KV

_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlash2Config(DraftConfig):
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # output_multiplier, final_logit_softcapping, input_embedding_scale: parsed by DraftConfig
    family = "dflash2"

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "drafter") -> "DFlash2Config":
        archs = cfg.get("architectures") or []
        if not archs or archs[0] != DRAFT2_ARCH:
            raise DFlashError(f"{where}: architecture {archs[0] if archs else None!r} is not {DRAFT2_ARCH}")
        nested = cfg.get("dflash_config") or {}
        value = {k: nested.get(k, cfg.get(k)) for k in _KEYS}  # dflash_config first, as z-lab reads them
        missing = [k for k in _KEYS if value[k] is None]
        if missing:
            raise DFlashError(f"{where}: DFlash2 config lacks {', '.join(missing)} (in dflash_config)")
        # the DFlash 1 backbone parses with the DFlash 2 keys taken out
        plain = {k: v for k, v in cfg.items() if k not in _KEYS}
        plain["architectures"] = [DRAFT_ARCH]
        plain["dflash_config"] = {k: v for k, v in nested.items() if k not in _KEYS}
        base = DraftConfig.from_dict(plain, where)
        kernel, group = int(value["conv_kernel_size"]), int(value["conv_group_size"])
        rank, top_k = int(value["selector_rank"]), int(value["selector_top_k"])
        if kernel < 1 or group < 1 or base.hidden_size % group:
            raise DFlashError(f"{where}: conv_kernel_size must be >= 1 and conv_group_size must divide "
                              f"hidden_size {base.hidden_size} (got {kernel}, {group})")
        if rank < 1 or top_k < 1:
            raise DFlashError(f"{where}: selector_rank and selector_top_k must be >= 1 (got {rank}, {top_k})")
        if base.vocab_size is None:
            raise DFlashError(f"{where}: config.json lacks 'vocab_size' (the selector's codebooks are per token)")
        out = cls(**{f.name: getattr(base, f.name) for f in fields(DraftConfig)},
                  conv_kernel_size=kernel, conv_group_size=group, selector_rank=rank, selector_top_k=top_k)
        out.raw = cfg
        return out

    @classmethod
    def load(cls, directory) -> "DFlash2Config":
        return cls.from_dict(read_config(directory, "drafter"), where=f"drafter {directory}")


def dynamic_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """x [B,K,H] along K with per-token kernels: out[i] = sum_t (base[t] + delta[i,t]) * x[i-t].

    base [T,H]; delta [B,K,T,H/group], one value per group of `group` channels."""
    k = x.shape[1]
    out = torch.zeros_like(x)
    for t in range(base.shape[0]):
        shifted = nn.functional.pad(x, (0, 0, t, 0))[:, :k]  # x[i - t], zeros before the block
        out = out + (base[t] + delta[:, :, t].repeat_interleave(group, -1)) * shifted
    return out


class DynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv`: the convolutions before (prepare) and after (finish) a sublayer."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.empty(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x convolved with the input kernel, the output kernel's deltas for `finish`)."""
        b, k, _ = x.shape
        delta = self.kernel_projection(x).view(b, k, 2, self.kernel, -1)
        return dynamic_conv(x, self.base_kernel[0], delta[:, :, 0], self.group), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return dynamic_conv(y, self.base_kernel[1], delta, self.group)


class CandidateSelector(nn.Module):
    """Codebooks stored as released: `predecessor_codebook` / `successor_codebook` [V, rank], no `.weight`."""

    def __init__(self, c: DFlash2Config):
        super().__init__()
        self.top_k = c.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B,N,V] -> (unary scores, candidate ids), both [B,N,k], best first."""
        return torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)

    def pair_scores(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor):
        """Every score the walk can need, as the drafter graph exports them: hidden [B,N,H],
        logits [B,N,V], anchor ids [B] -> (candidates [B,N,k], scores [B,N,k,k] fp32) where
        scores[b,i,p,c] = unary[c] + <pred_code[prev_p] * proj(h_i), succ_code[cand_c]>, prev_p
        the p-th candidate of position i-1 (position 0: the anchor, on every row p)."""
        unary, cand = self.candidates(logits)
        h = self.hidden_projection(hidden).float()  # [B,N,R]
        b, n, k = cand.shape
        prev = torch.cat([anchor[:, None, None].expand(b, 1, k), cand[:, :-1]], 1)  # [B,N,k]
        query = self.predecessor_codebook[prev].float() * h[:, :, None]  # [B,N,k,R]
        pair = torch.matmul(query, self.successor_codebook[cand].float().transpose(-1, -2))  # [B,N,k(prev),k(cand)]
        return cand, unary.float()[:, :, None, :] + pair

    def sample_walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, temperature: float,
                    u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The walk at temperature T > 0, one uniform per position (u [B,N]): each step draws from
        q = softmax(scores / T) over its candidates. -> (path [B,N], candidates [B,N,k],
        q [B,N,k]): q is the draft distribution that rejection sampling needs."""
        cand, scores = self.pair_scores(hidden, logits, anchor)
        b = torch.arange(cand.shape[0])
        p, path, qs = torch.zeros_like(anchor), [], []
        for i in range(cand.shape[1]):
            q = torch.softmax(scores[b, i, p] / temperature, -1)
            p = (q.cumsum(-1) <= u[:, i : i + 1]).sum(-1).clamp_max(q.shape[-1] - 1)  # inverse CDF
            path.append(cand[b, i, p])
            qs.append(q)
        return torch.stack(path, 1), cand, torch.stack(qs, 1)


def greedy_walk(cand: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy walk over `pair_scores`: from row 0 (the anchor), at each position the best
    candidate given the one chosen before. -> (path [B,N] ids, conf [B,N]: the chosen
    candidate's softmax probability among its k, at temperature 1)."""
    b = torch.arange(cand.shape[0], device=cand.device)
    p = torch.zeros(cand.shape[0], dtype=torch.long, device=cand.device)
    path, conf = [], []
    for i in range(cand.shape[1]):  # static: K-1 steps of a gather and an argmax
        row = scores[b, i, p]  # [B,k]
        p = row.argmax(-1)
        path.append(cand[b, i, p])
        conf.append(torch.softmax(row, -1).gather(1, p[:, None])[:, 0])
    return torch.stack(path, 1), torch.stack(conf, 1)


class DFlash2Drafter(Drafter):
    config_type = DFlash2Config

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        c = config
        for layer in self.layers:
            layer.attention_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            layer.mlp_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        self.candidate_selector = CandidateSelector(c)

    def set_draft_vocab(self, ids, lm_head_weight) -> None:
        raise DFlashError("a reduced draft vocabulary is not supported for DFlash2 drafters (the selector scores full-vocabulary ids)")

    def wrap_in(self, layer, sublayer: str, h: torch.Tensor):
        return (layer.attention_conv if sublayer == "attention" else layer.mlp_conv).prepare(h)

    def wrap_out(self, layer, sublayer: str, y: torch.Tensor, late) -> torch.Tensor:
        return (layer.attention_conv if sublayer == "attention" else layer.mlp_conv).finish(y, late)

    def block_outputs(self, target, block_ids: torch.Tensor, block_position_ids: torch.Tensor, past_ctx: KV,
                      ctx_lengths: torch.Tensor | None = None, position_major: bool = False, ring: int | None = None):
        """One drafter pass and the selector, as draft_block returns them (its outputs, then contract.SELECTOR_OUTPUTS):
        -> (greedy path [B,K-1], logits [B,K-1,V], its conf, candidates [B,K-1,k], scores [B,K-1,k,k])."""
        hidden = self.draft_hidden(target, block_ids, block_position_ids, past_ctx, ctx_lengths, position_major, ring)
        logits = self.head(target, hidden)
        cand, scores = self.candidate_selector.pair_scores(hidden, logits, block_ids[:, 0])
        path, conf = greedy_walk(cand, scores)
        return path, logits, conf, cand, scores

    def propose(self, target, block_ids: torch.Tensor, block_position_ids: torch.Tensor, past_ctx: KV,
                ctx_lengths: torch.Tensor | None = None, position_major: bool = False) -> torch.Tensor:
        """Greedy drafts [B,K-1]: the selector's walk from the anchor `block_ids[:, 0]`."""
        return self.block_outputs(target, block_ids, block_position_ids, past_ctx, ctx_lengths, position_major)[0]

    def draft_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        raise DFlashError("DFlash2 drafts come from the selector walk (DFlash2Drafter.propose), not an argmax")


def load_drafter(directory, dtype: torch.dtype = torch.float32, *, config: DraftConfig | None = None) -> Drafter:
    """The drafter in `directory` of either family (DFlash 1 or DFlash 2, by its config:
    `config` if the caller parsed it already with load_draft_config, to check it before any
    weight is read)."""
    config = config or load_draft_config(directory)
    cls = DFlash2Drafter if config.family == "dflash2" else Drafter
    return cls.from_pretrained(directory, dtype, config)


def load_draft_config(directory) -> DraftConfig:
    """The config of either drafter family in a drafter directory, by its architecture."""
    cfg = read_config(directory, "drafter")
    cls = DFlash2Config if (cfg.get("architectures") or [None])[0] == DRAFT2_ARCH else DraftConfig
    return cls.from_dict(cfg, f"drafter {directory}")
