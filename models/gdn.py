"""The gated delta rule (Gated DeltaNet's recurrence) as plain tensor math, export-ready.

Per value head, with a state S [Dk, Dv], decay g_t <= 0 (log space), rate beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
    o_t = S_t^T q_t

`u_t` (the delta rule's correction) is a per-token quantity: whatever the chunking, the
state after the first n tokens of a call is

    S_n = exp(c_n) S_0 + sum_{j<=n} exp(c_n - c_j) k_j u_j^T,   c = cumsum(g)

so a call returns (k, u, g) per token and the caller commits any prefix of them (`commit`):
the recurrent state then rolls back by length, like an attention KV cache.

One call is one chunk (chunk form of the delta rule, as transformers' torch reference):
the unit lower-triangular system is inverted by repeated squaring, (I + L)^-1 =
(I - L)(I + L^2)(I + L^4)... (L is nilpotent), so the graph is matmuls only: no
triangular solve, no CumSum, no loop.
"""

from __future__ import annotations

import torch

CHUNK = 64  # most positions per call (the exported graph inverts a CHUNK x CHUNK system at most)
_SQUARINGS = (CHUNK - 1).bit_length()  # (I - L) times this many - 1 factors cover L^0 .. L^(CHUNK-1)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _lower(s: int, device, strict: bool) -> torch.Tensor:
    i = torch.arange(s, device=device)
    return (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., S, S], S <= CHUNK, by matmuls only."""
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    inv, power = eye - lower, lower
    for _ in range(_SQUARINGS - 1):
        power = power @ power
        inv = inv + inv @ power
    return inv


def chunk(q, k, v, g, beta, state):
    """One chunk of the gated delta rule, S <= CHUNK positions, all heads at once.

    q, k [B,H,S,Dk] (l2-normed; q already scaled), v [B,H,S,Dv], g, beta [B,H,S],
    state [B,H,Dk,Dv] (fp32) -> outputs [B,H,S,Dv] and the corrections u [B,H,S,Dv].
    """
    s = q.shape[2]
    tri = _lower(s, q.device, strict=False).to(g.dtype)
    cum = g @ tri.transpose(0, 1)  # cumsum along S, as a matmul
    diff = cum[..., :, None] - cum[..., None, :]
    decay = torch.where(_lower(s, q.device, strict=False), diff, torch.full_like(diff, -torch.inf)).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    inv = unit_lower_inverse(system * _lower(s, q.device, strict=True).to(system.dtype))
    u = inv @ (v * beta[..., None]) - (inv @ (k_beta * cum.exp()[..., None])) @ state
    out = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ u
    return out, u


def commit(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The state after the given tokens: state [B,H,Dk,Dv], k [B,S,H,Dk], u [B,S,H,Dv], g [B,S,H].

    Exact for any S (no triangular system); applied per call, so cumulative decays span
    one call's positions and stay well-conditioned in fp32.
    """
    if k.shape[1] == 0:
        return state
    cum = g.float().cumsum(1)  # B S H
    w = (cum[:, -1:] - cum).exp()  # decay from each token to the end
    upd = torch.einsum("bsh,bshk,bshv->bhkv", w, k.float(), u.float())
    return state * cum[:, -1].exp()[..., None, None] + upd
