"""The mixture-of-experts MLP of the Qwen line (Qwen3-MoE, Qwen3.5 / 3.6-MoE, Qwen3-Next), and
the experts of gpt-oss (biased router and experts, clamped SwiGLU: models/gpt_oss.py) and
Gemma 4 (GeGLU experts beside the dense MLP: models/gemma4.py), which MoeConfig describes.

Semantics are transformers 5.x's `Qwen3MoeSparseMoeBlock` (and its Qwen3.5-MoE / Qwen3-Next
copies): router logits = Linear(H -> E); softmax in fp32; top-k; the k probabilities
renormalised to sum 1 when `norm_topk_prob`; each selected expert a SwiGLU
`down(silu(gate(x)) * up(x))` weighted by its probability; plus, for Qwen3.5-MoE and
Qwen3-Next, a shared expert (a plain SwiGLU MLP) times `sigmoid(Linear(H -> 1))`.

Parameter names are transformers 5.x's, so its state dict loads as is: the router
`mlp.gate.weight [E, H]`, the experts fused as `mlp.experts.gate_up_proj [E, 2I, H]` (gate
rows, then up rows) and `mlp.experts.down_proj [E, H, I]`. Released safetensors keep one
key per expert (`mlp.experts.{e}.gate_proj.weight` ...): `fuse_experts` stacks them.

`SparseMoe.forward` is the reference (the oracle and `check` use it): only the experts a
token selected run, like transformers' loop, so a 30B-class model runs at its active size.
Its data-dependent loop cannot be traced: export/moe.py installs a graph form on each block
(`SparseMoe.graph_experts`): ONNX Runtime's com.microsoft::MoE, or gathered standard ops.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.nn import functional as F

from ..runtime.errors import DFlashError
from .config import MoeConfig, TargetConfig
from .layers import MLP


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]).

    fp32 softmax over all experts, then top-k (transformers' order: the renormalised
    weights equal a softmax over the k selected logits)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class Experts(nn.Module):
    """E gated experts as two 3-D parameters (transformers 5.x's fused layout), optionally biased.

    `interleaved`: gate_up_proj's rows are g0, u0, g1, u1, ... instead of [gate; up]: the
    layout ONNX Runtime's MoE op reads on CPU (export/moe.py stores it so, once; gpt-oss's
    checkpoints hold it so). The activation is MoeConfig's: Qwen's SwiGLU, gpt-oss's clamped
    one, Gemma 4's GeGLU."""

    def __init__(self, num_experts: int, hidden: int, width: int, moe: MoeConfig | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        if moe is not None and moe.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * width))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.interleaved = False
        self.activation, self.alpha, self.beta, self.limit = (
            (moe.activation, moe.alpha, moe.beta, moe.limit) if moe is not None else ("swiglu", 1.0, 0.0, None))

    @property
    def biased(self) -> bool:
        return hasattr(self, "down_proj_bias")

    def swiglu(self, h: torch.Tensor) -> torch.Tensor:
        """[..., 2I] products of gate_up_proj -> act(gate) * up [..., I], in either layout."""
        gate, up = (h[..., 0::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)
        if self.activation == "geglu":
            return F.gelu(gate, approximate="tanh") * up
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        act = F.silu(gate) if self.alpha == 1.0 else gate * torch.sigmoid(gate * self.alpha)
        return act * (up + self.beta) if self.beta else act * up

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] -> sum over each token's k experts [T, H].

        Expert by expert in increasing id, each over the tokens that chose it (transformers'
        order of additions, so fp32 results agree to rounding)."""
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            h = F.linear(x[token], self.gate_up_proj[e], self.gate_up_proj_bias[e] if self.biased else None)
            y = F.linear(self.swiglu(h), self.down_proj[e], self.down_proj_bias[e] if self.biased else None)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class SparseMoe(nn.Module):
    """One layer's MoE block: router, routed experts, optional gated shared expert."""

    def __init__(self, hidden: int, moe: MoeConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(hidden, moe.num_experts, bias=moe.bias)  # the router
        self.experts = Experts(moe.num_experts, hidden, moe.expert_size, moe)
        if moe.shared_expert_size:
            self.shared_expert = MLP(hidden, moe.shared_expert_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.shared = bool(moe.shared_expert_size)
        # export/moe.py: (block, tokens [T, H], router logits [T, E]) -> routed output [T, H] as graph ops
        self.graph_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H]; tokens are independent, so B*S rows go through at once."""
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        logits = self.gate(t)
        if self.graph_experts is not None:
            y = self.graph_experts(self, t, logits)
        else:
            weights, ids = route(logits, self.top_k, self.norm_topk_prob)
            y = self.experts(t, ids, weights)
        y = y.reshape(shape)
        if self.shared:  # on [B, S, H]: traced as MatMul like the dense MLP, so `quantize` takes it
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


def mlp_for(c: TargetConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: the MoE block where the config routes it, else the dense SwiGLU."""
    if c.moe is not None and layer in c.moe.sparse_layers:
        return SparseMoe(c.hidden_size, c.moe)
    return MLP(c.hidden_size, c.intermediate_size, c.mlp_bias)


def blocks(model: nn.Module) -> list[nn.Module]:
    """Every MoE block of a target, in layer order: SparseMoe, or a family's own block with the
    same `experts`, `top_k`, `norm_topk_prob` and `graph_experts` (Gemma 4's, models/gemma4.py)."""
    return [m for m in model.modules() if hasattr(m, "graph_experts") and isinstance(getattr(m, "experts", None), Experts)]


# -- checkpoints: one key per expert (released safetensors) -> transformers 5.x's fused layout --

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(state: dict[str, torch.Tensor], c: TargetConfig, where: str) -> dict[str, torch.Tensor]:
    """Stack per-expert keys into `experts.gate_up_proj [E, 2I, H]` and `experts.down_proj
    [E, H, I]` (the model's layout; a fused checkpoint passes through). Every expert tensor
    is checked against the config first: a mismatch is one line naming the tensor and both
    shapes. Each layer's per-expert tensors are released as soon as they are stacked."""
    if c.moe is None:
        return state
    h, width, n = c.hidden_size, c.moe.expert_size, c.moe.num_experts
    want = {"gate_proj": (width, h), "up_proj": (width, h), "down_proj": (h, width)}
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for name in list(state):
        m = _PER_EXPERT.match(name)
        if m is None:
            continue
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        got = tuple(state[name].shape)
        if got != want[proj]:
            raise DFlashError(f"{where}: expert tensor {name} has shape {list(got)}, but the config "
                              f"(hidden_size {h}, moe_intermediate_size {width}) says {list(want[proj])}")
        groups.setdefault(prefix, {}).setdefault(e, {})[proj] = name
    for prefix, experts in groups.items():
        if sorted(experts) != list(range(n)):
            extra = sorted(set(experts) - set(range(n)))
            what = f"experts {extra[:3]} beyond" if extra else f"{len(experts)} experts for"
            raise DFlashError(f"{where}: {prefix} has {what} the config's num_experts {n}")
        incomplete = [f"{prefix}.{e}.{p}.weight" for e in range(n) for p in want if p not in experts[e]]
        if incomplete:
            raise DFlashError(f"{where}: missing expert tensor {incomplete[0]}"
                              + (f" (+{len(incomplete) - 1} more)" if len(incomplete) > 1 else ""))
        take = lambda e, p: state.pop(experts[e][p])  # noqa: E731
        state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([take(e, "gate_proj"), take(e, "up_proj")], 0) for e in range(n)])
        state[f"{prefix}.down_proj"] = torch.stack([take(e, "down_proj") for e in range(n)])
    for name, t in state.items():  # a fused checkpoint: name the tensor and both shapes as above
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            expect = (n, 2 * width, h) if name.endswith("gate_up_proj") else (n, h, width)
            if tuple(t.shape) != expect:
                raise DFlashError(f"{where}: expert tensor {name} has shape {list(t.shape)}, but the config "
                                  f"(num_experts {n}, hidden_size {h}, moe_intermediate_size {width}) says {list(expect)}")
    return state
