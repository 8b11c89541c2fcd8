"""The loop in flight (what `serve --max-batch` drives): requests join at round boundaries
while other rows run (`poll`), a dropped row leaves within one round (`drop`), a plain row
rides in a speculative batch (`Request.speculative`); every other row's output stays its
own batch-1 output, token for token."""

from __future__ import annotations

import pytest
from runtime_cases import CASES, ORT_CASES, artifact, prompts

from dflash_export.runtime.loop import Generation, Request, generate, stream_batch
from dflash_export.runtime.ort.backend import OrtBackend


@pytest.mark.parametrize("case", [CASES["qwen3"], ORT_CASES["qwen3-ort"]], ids=["standard", "ort"])
def test_rows_join_while_others_run_and_a_dropped_row_leaves_within_one_round(case):
    _, _, out = artifact(case)
    be1, be3 = OrtBackend(out, threads=1), OrtBackend(out, threads=1, max_batch=3)
    ps = prompts(6, be1.manifest.vocab_size, seed=11)
    plain, victim = {1, 4}, 2  # plain rows decode without drafts in the speculative batch; the victim is cancelled
    reqs = [Request(p, 20, stop_token_ids=(), speculative=i not in plain) for i, p in enumerate(ps)]
    refs = [generate(be1, q.prompt, 20, stop_token_ids=(), draft=q.speculative).tokens for q in reqs]
    arrivals = {0: [0], 2: [1, 2], 3: [3], 5: [4, 5]}  # round boundary -> requests that arrive then
    waiting, asked, joined, outs = [], [], [], []  # joined[loop index] = request number
    outs: list[Generation]

    def poll(free, idle):
        while True:  # idle with nothing waiting: a server blocks until a request arrives
            waiting.extend(arrivals.pop(len(asked), []))
            asked.append((free, idle))
            if waiting or not idle or not arrivals:
                break
        given = [waiting.pop(0) for _ in range(min(free, len(waiting)))]
        joined.extend(given)
        return [reqs[i] for i in given]

    def drop(index):  # the victim, after its second round
        return joined[index] == victim and len(outs[index].acceptance_lengths) >= 2

    got: dict[int, list[int]] = {}
    for index, tokens in stream_batch(be3, [], outs=outs, poll=poll, drop=drop):
        got.setdefault(joined[index], []).extend(tokens)
    gen = {joined[i]: g for i, g in enumerate(outs)}
    assert sorted(got) == list(range(6)) and not arrivals
    for i, ref in enumerate(refs):
        if i == victim:  # no round after the drop; what it had is its own output's start
            assert len(gen[i].acceptance_lengths) == 2 and not gen[i].finished
            assert got[i] == ref[: len(got[i])] and len(got[i]) < len(ref)
        else:
            assert got[i] == ref and gen[i].finished, i
    assert all(set(gen[i].verify_lengths) == {1} for i in plain)
    assert all(max(gen[i].verify_lengths) > 1 for i in (0, 3, 5))
    assert any(free < 3 and not idle for free, idle in asked)  # requests joined a running batch
