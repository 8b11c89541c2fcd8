"""The reference speculative generator: the oracle every backend is compared with.

Round structure (docs/design.md, "The loop"), with the z-lab reference's bookkeeping:
prefill the prompt -> first token; then each round drafts a block [anchor, MASK...],
verifies it in one target pass, accepts the longest matching prefix `a` plus the target's
own choice at `a`, and keeps `a + 1` positions in the target cache (rollback = length).
The tokens are the prefill token plus every round's `a + 1`:
`len(tokens) == 1 + sum(acceptance_lengths)` (less when a stop token or the limit cuts).

At temperature > 0 (runtime/sampling.py has the rules and the randomness layout): by
default the drafts are samples from the drafter's q and the round verifies them by
rejection sampling against the target's p (the official reference's rule);
`Sampling(method="compare")` drafts the argmax and compares it with a target sample at each
position. Either way every emitted token is an exact target sample given its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..runtime.errors import DFlashError
from ..runtime.sampling import (GREEDY, Sampling, accept, check_request, choose, cut_at_stop, draft_uniforms,
                                position_uniforms, probabilities, rejection, sample_drafts)
from .kvcache import KVCache


@dataclass
class Generation:
    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    stopped: bool = False

    @property
    def tau(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0


def _target_cache(target, max_len: int):
    """The target's cache: static K/V, or for hybrid targets K/V plus committed DeltaNet states."""
    return target.new_cache(max_len) if hasattr(target, "new_cache") else KVCache.for_model(target, max_len)


def check_pair(target, drafter, prompt: list[int], max_new_tokens: int, max_context: int | None,
               mask_token_id: int) -> int:
    """Refuse, in one line, a request or a target/drafter pair the oracle cannot run; the max length."""
    max_length = check_request(prompt, max_new_tokens, target.config.vocab_size, max_context)
    drafter.config.check_fits(target.config)
    if list(target.tap_ids) != list(drafter.config.target_layer_ids):
        raise DFlashError(f"the target taps layers {list(target.tap_ids)} but the drafter reads "
                          f"{drafter.config.target_layer_ids}; load the target with tap_ids=drafter.config.target_layer_ids")
    if not 0 <= mask_token_id < target.config.vocab_size:
        raise DFlashError(f"mask_token_id {mask_token_id} is outside the vocabulary [0, {target.config.vocab_size})")
    return max_length


@torch.inference_mode()
def speculative_generate(
    target,
    drafter,
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
    if k < 1:
        raise DFlashError(f"block size must be >= 1 (got {k})")

    def draft(block, positions, past, ud):
        """The drafter's argmax (ud None), or samples of q at the draft uniforms ud."""
        dlogits = drafter.draft_logits(target, block, positions, past)
        if ud is None:
            return drafter.draft_tokens(dlogits)[0].tolist(), None
        ids = getattr(drafter, "vocab_ids", None)
        drafted = sample_drafts(dlogits[0].numpy(), ud, sampling, None if ids is None else ids.numpy())
        return drafted.tokens.tolist(), drafted

    return speculative_loop(target, drafter, prompt, max_new_tokens, draft, mask_token_id=mask_token_id, k=k,
                            sampling=sampling, stop_token_ids=stop_token_ids, max_context=max_context)


def speculative_loop(target, drafter, prompt: list[int], max_new_tokens: int, draft, *, mask_token_id: int, k: int,
                     sampling: Sampling, stop_token_ids: tuple[int, ...], max_context: int | None) -> Generation:
    """The rounds, whatever drafts them: `draft(block, positions, past, ud)` -> (drafts, Drafted
    or None), ud the draft uniforms from the block's second position (None: greedy or compare).
    Shared by the DFlash and DFlash 2 oracles (models/generate_dflash2.py), which differ only there."""
    max_length = check_pair(target, drafter, prompt, max_new_tokens, max_context, mask_token_id)
    u = position_uniforms(sampling.seed, max_length + 1)  # u[t]: the token at absolute position t
    ud = draft_uniforms(sampling.seed, max_length + 1) if not sampling.greedy and sampling.method == "rejection" else None
    stop = set(stop_token_ids)
    n = len(prompt)
    tcache, dcache = _target_cache(target, max_length), KVCache.for_model(drafter, max_length)

    logits, taps, _ = target(torch.tensor([prompt]), torch.arange(n)[None], tcache)
    tcache.commit(n)
    anchor = int(choose(logits[0, -1:].numpy(), u[n:], sampling)[0])
    out, lengths, start = [anchor], [], n  # `start` = position of the anchor
    ctx_taps, ctx_pos = taps, torch.arange(n)[None]
    stopped = anchor in stop
    while not stopped and start + 1 < max_length:
        dcache.append(drafter.context_kv(ctx_taps, ctx_pos))
        block = torch.tensor([[anchor] + [mask_token_id] * (k - 1)])
        positions = torch.arange(start, start + k)[None]
        drafts, drafted = draft(block, positions, dcache.view(), None if ud is None else ud[start + 1 :, 0])

        s = min(k, max_length - start)  # verify no further than the generation can go
        verify = torch.tensor([[anchor] + drafts[: s - 1]])
        logits, taps, _ = target(verify, positions[:, :s], tcache)
        if drafted is None:
            choice = choose(logits[0].numpy(), u[start + 1 :], sampling).tolist()
            a = accept(drafts[: s - 1], choice[: s - 1])
            last = choice[a]
        else:
            p = probabilities(logits[0].numpy(), sampling)
            a, last = rejection(drafted, s - 1, p, ud[start + 1 :, 1], u[start + 1 :])
        emitted = (drafts[:a] + [last])[: max_length - start - 1]
        emitted, stopped = cut_at_stop(emitted, stop)
        produced = len(emitted)

        tcache.commit(produced)  # anchor + accepted drafts; the new anchor is not cached yet
        ctx_taps, ctx_pos = taps[:, :produced], positions[:, :produced]
        out += emitted
        lengths.append(produced)
        start += produced
        anchor = emitted[-1]
    return Generation(out, lengths, stopped)


@torch.inference_mode()
def autoregressive_generate(
    target,
    prompt: list[int],
    max_new_tokens: int,
    *,
    sampling: Sampling = GREEDY,
    stop_token_ids: tuple[int, ...] = (),
    max_context: int | None = None,
) -> Generation:
    """Plain decoding of the target, one token per step, on the same static cache."""
    max_length = check_request(prompt, max_new_tokens, target.config.vocab_size, max_context)
    u = position_uniforms(sampling.seed, max_length + 1)
    cache = _target_cache(target, max_length)
    ids, pos = torch.tensor([prompt]), torch.arange(len(prompt))[None]
    out: list[int] = []
    while True:
        logits, _, _ = target(ids, pos, cache)
        cache.commit(ids.shape[1])
        tok = int(choose(logits[0, -1:].numpy(), u[cache.length :], sampling)[0])
        out.append(tok)
        if tok in stop_token_ids:
            return Generation(out, [1] * (len(out) - 1), True)
        if len(out) >= max_new_tokens:
            return Generation(out, [1] * (len(out) - 1), False)
        ids, pos = torch.tensor([[tok]]), torch.tensor([[cache.length]])
