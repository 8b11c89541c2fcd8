"""The reference generator for DFlash 2 pairs: `speculative_generate`'s loop with the drafts
chosen by the selector walk instead of an argmax. Verification is unchanged.

Greedy (T = 0): the greedy walk's drafts, the longest prefix equal to the target's argmax plus
the target's own token, so the output is the target's greedy output.

Sampled (T > 0), runtime/sampling.py's rules and randomness layout: by default
(`sampling="rejection"`) the walk draws each draft from q = softmax(scores[i, prev] / T) over
its position's k candidates at that position's draft uniform (the PyTorch selector's
`sample_walk`, checked against the official one), and the round verifies the drafts by
rejection sampling with that q spread over the candidate ids (no top-k / top-p on q, as the
official reference); `sampling="compare"` verifies the greedy walk against target samples.
Either way every emitted token is an exact sample of the target given its prefix.
"""

from __future__ import annotations

import numpy as np
import torch

from ..runtime.errors import DFlashError
from ..runtime.sampling import (Drafted, accept, check_sampling, choose, cut_at_stop, draft_uniforms,
                                position_uniforms, probabilities, rejection)
from .dflash2 import DFlash2Drafter
from .generate import Generation, _target_cache, check_pair
from .kvcache import KVCache


def walk_drafts(drafter: DFlash2Drafter, target, block, positions, past, ud: np.ndarray | None,
                temperature: float) -> tuple[list[int], Drafted | None]:
    """One drafter pass: the greedy walk's drafts (ud None), or the sampled walk's at the draft
    uniforms ud [n] (n <= K-1; positions past them draw at 0.5 and are never verified)."""
    if ud is None:
        return drafter.propose(target, block, positions, past)[0].tolist(), None
    hidden = drafter.draft_hidden(target, block, positions, past)
    logits = drafter.head(target, hidden)
    n = hidden.shape[1]
    u = torch.full((1, n), 0.5, dtype=torch.float64)
    u[0, : min(n, len(ud))] = torch.from_numpy(np.asarray(ud[:n], np.float64))
    path, cand, q = drafter.candidate_selector.sample_walk(hidden, logits, block[:, 0], temperature, u)
    path, cand, q = path[0].numpy(), cand[0].numpy(), q[0].double().numpy()
    pick = (cand == path[:, None]).argmax(-1)  # candidates are distinct ids: the drawn one's index
    return path.tolist(), Drafted(path.astype(np.int64), q, q[np.arange(n), pick], cand.astype(np.int64))


@torch.inference_mode()
def dflash2_generate(
    target,
    drafter: DFlash2Drafter,
    prompt: list[int],
    max_new_tokens: int,
    *,
    mask_token_id: int,
    block_size: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    max_context: int | None = None,
    sampling: str = "rejection",
) -> Generation:
    check_sampling(temperature, top_k, top_p, sampling)
    k = drafter.config.block_size if block_size is None else block_size
    max_length = check_pair(target, drafter, prompt, max_new_tokens, max_context, mask_token_id)
    if k < 2:
        raise DFlashError(f"block size must be >= 2 for a DFlash2 drafter (got {k})")
    u = position_uniforms(seed, max_length + 1)  # u[t]: the token at absolute position t
    ud = draft_uniforms(seed, max_length + 1) if temperature > 0 and sampling == "rejection" else None
    stop = set(stop_token_ids)
    n = len(prompt)
    tcache, dcache = _target_cache(target, max_length), KVCache.for_model(drafter, max_length)

    logits, taps, _ = target(torch.tensor([prompt]), torch.arange(n)[None], tcache)
    tcache.commit(n)
    anchor = int(choose(logits[0, -1:].numpy(), u[n:], temperature, top_k, top_p)[0])
    out, lengths, start = [anchor], [], n  # `start` = position of the anchor
    ctx_taps, ctx_pos = taps, torch.arange(n)[None]
    stopped = anchor in stop
    while not stopped and start + 1 < max_length:
        dcache.append(drafter.context_kv(ctx_taps, ctx_pos))
        block = torch.tensor([[anchor] + [mask_token_id] * (k - 1)])
        positions = torch.arange(start, start + k)[None]
        drafts, drafted = walk_drafts(drafter, target, block, positions, dcache.view(),
                                      None if ud is None else ud[start + 1 :, 0], temperature)

        s = min(k, max_length - start)  # verify no further than the generation can go
        verify = torch.tensor([[anchor] + drafts[: s - 1]])
        logits, taps, _ = target(verify, positions[:, :s], tcache)
        if drafted is None:
            choice = choose(logits[0].numpy(), u[start + 1 :], temperature, top_k, top_p).tolist()
            a = accept(drafts[: s - 1], choice[: s - 1])
            last = choice[a]
        else:
            p = probabilities(logits[0].numpy(), temperature, top_k, top_p)
            a, last = rejection(drafted, s - 1, p, ud[start + 1 :, 1], u[start + 1 :])
        emitted = (drafts[:a] + [last])[: max_length - start - 1]
        emitted, stopped = cut_at_stop(emitted, stop)
        produced = len(emitted)

        tcache.commit(produced)
        ctx_taps, ctx_pos = taps[:, :produced], positions[:, :produced]
        out += emitted
        lengths.append(produced)
        start += produced
        anchor = emitted[-1]
    return Generation(out, lengths, stopped)
