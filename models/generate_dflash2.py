"""The reference generator for DFlash 2 pairs: `speculative_generate`'s loop with the drafts
chosen by the selector walk instead of an argmax. Verification is unchanged.

Greedy (T = 0): the greedy walk's drafts, the longest prefix equal to the target's argmax plus
the target's own token, so the output is the target's greedy output.

Sampled (T > 0), runtime/sampling.py's rules and randomness layout: by default
(`Sampling.method` "rejection") the walk draws each draft from q = softmax(scores[i, prev] / T) over
its position's k candidates at that position's draft uniform (the PyTorch selector's
`sample_walk`, checked against the official one), and the round verifies the drafts by
rejection sampling with that q spread over the candidate ids (no top-k / top-p on q, as the
official reference); "compare" verifies the greedy walk against target samples.
Either way every emitted token is an exact sample of the target given its prefix.
"""

from __future__ import annotations

import numpy as np
import torch

from ..runtime.errors import DFlashError
from ..runtime.sampling import GREEDY, Drafted, Sampling
from .dflash2 import DFlash2Drafter
from .generate import Generation, speculative_loop


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
    sampling: Sampling = GREEDY,
    stop_token_ids: tuple[int, ...] = (),
    max_context: int | None = None,
) -> Generation:
    k = drafter.config.block_size if block_size is None else block_size
    if k < 2:
        raise DFlashError(f"block size must be >= 2 for a DFlash2 drafter (got {k})")
    return speculative_loop(target, drafter, prompt, max_new_tokens,
                            lambda block, positions, past, ud: walk_drafts(drafter, target, block, positions, past, ud,
                                                                           sampling.temperature),
                            mask_token_id=mask_token_id, k=k, sampling=sampling, stop_token_ids=stop_token_ids,
                            max_context=max_context)
