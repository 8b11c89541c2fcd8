"""The reference greedy generator for DFlash 2 pairs: `speculative_generate`'s loop with the
drafts chosen by the selector walk instead of an argmax. Verification is unchanged: the
longest matching prefix plus the target's own token, so the output is the target's greedy.

Sampling (T > 0, rejection sampling with q = softmax(walk scores / T) over the candidates)
is not implemented here yet and is refused.
"""

from __future__ import annotations

import torch

from ..runtime.errors import DFlashError
from ..runtime.sampling import accept, cut_at_stop
from .dflash2 import DFlash2Drafter
from .generate import Generation, _target_cache, check_pair
from .kvcache import KVCache


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
    stop_token_ids: tuple[int, ...] = (),
    max_context: int | None = None,
) -> Generation:
    if temperature != 0:
        raise DFlashError("DFlash2 sampling (temperature > 0) is not implemented yet; use temperature 0")
    k = drafter.config.block_size if block_size is None else block_size
    max_length = check_pair(target, drafter, prompt, max_new_tokens, max_context, mask_token_id)
    if k < 2:
        raise DFlashError(f"block size must be >= 2 for a DFlash2 drafter (got {k})")
    stop = set(stop_token_ids)
    n = len(prompt)
    tcache, dcache = _target_cache(target, max_length), KVCache.for_model(drafter, max_length)

    logits, taps, _ = target(torch.tensor([prompt]), torch.arange(n)[None], tcache)
    tcache.commit(n)
    anchor = int(logits[0, -1].argmax())
    out, lengths, start = [anchor], [], n  # `start` = position of the anchor
    ctx_taps, ctx_pos = taps, torch.arange(n)[None]
    stopped = anchor in stop
    while not stopped and start + 1 < max_length:
        dcache.append(drafter.context_kv(ctx_taps, ctx_pos))
        block = torch.tensor([[anchor] + [mask_token_id] * (k - 1)])
        positions = torch.arange(start, start + k)[None]
        drafts = drafter.propose(target, block, positions, dcache.view())[0].tolist()

        s = min(k, max_length - start)  # verify no further than the generation can go
        verify = torch.tensor([[anchor] + drafts[: s - 1]])
        logits, taps, _ = target(verify, positions[:, :s], tcache)
        choice = logits[0].argmax(-1).tolist()
        a = accept(drafts[: s - 1], choice[: s - 1])
        emitted = (drafts[:a] + [choice[a]])[: max_length - start - 1]
        emitted, stopped = cut_at_stop(emitted, stop)
        produced = len(emitted)

        tcache.commit(produced)
        ctx_taps, ctx_pos = taps[:, :produced], positions[:, :produced]
        out += emitted
        lengths.append(produced)
        start += produced
        anchor = emitted[-1]
    return Generation(out, lengths, stopped)
