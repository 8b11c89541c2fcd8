"""lm-eval (0.4.x) `local-completions` unmodified against `serve`: a local multiple-choice task
(loglikelihood requests: token-id prompts, echo, max_tokens 1, logprobs 1, several prompts per
request) and a generate-until task, from task files written here (no dataset download;
HF_DATASETS_OFFLINE). The scores lm-eval logs equal the same sums computed from transformers'
model of the same checkpoint within 1e-4 (fp32), its is_greedy flags equal the argmax test on
those logits, and the generations equal the loop's greedy output.

lm-eval runs in its own process (its CLI, as a user runs it), with the remote tokenizer it finds
through the server's /tokenizer_info and /tokenize; the served tokenizer is one token per
character, so the reference tokenizes by hand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from runtime_cases import CASES, artifact
from test_serve import Server, art, offline  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="lm-eval is not installed (the dev extra brings it)")

LETTERS = "abcdefghij "


def _tasks(d, greedy):
    """The task files; the first two questions' first choice is the model's own greedy
    continuation (so lm-eval's is_greedy is True for it), the rest random."""
    rng = np.random.default_rng(0)

    def word(lo, hi):
        return "".join(rng.choice(list(LETTERS[:-1]), int(rng.integers(lo, hi))))

    with open(d / "mc.jsonl", "w") as f:
        for i in range(6):
            q, choices = word(6, 14), [word(2, 6) for _ in range(3)]
            if i < 2:
                choices[0] = greedy(q, 3)
            f.write(json.dumps({"question": q, "choices": choices, "answer": i % 3}) + "\n")
    with open(d / "gen.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"question": word(6, 14), "answer": "x"}) + "\n")
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (d / "mc.yaml").write_text("task: dflash_mc\n" + common.format(d / "mc.jsonl") + (
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n"))
    (d / "gen.yaml").write_text("task: dflash_gen\n" + common.format(d / "gen.jsonl") + (
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"z\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"))


def test_lm_eval_local_completions_scores_equal_transformers(art, offline, tmp_path):
    import torch

    from dflash_export.models.tiny import hf_model

    vocab = json.loads((art / "tokenizer.json").read_text())["model"]["vocab"]
    chars = {v: k for k, v in vocab.items()}

    def greedy(text: str, n: int) -> str:
        return "".join(chars[t] for t in offline([vocab[c] for c in text], n, stop_token_ids=()).tokens)

    _tasks(tmp_path, greedy)
    s = Server(art, tmp_path / "serve.log", "--max-batch", 2)
    try:
        out = tmp_path / "results"
        env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
                            "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
               f"base_url={s.url}/v1/completions,model=tiny-chat,tokenizer_backend=remote,num_concurrent=1,"
               "max_retries=1,tokenized_requests=True,max_length=256", "--tasks", "dflash_mc,dflash_gen",
               "--include_path", str(tmp_path), "--output_path", str(out), "--log_samples", "--batch_size", "2"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert s.stop(signal.SIGINT) == 0
    finally:
        s.kill()
    samples = {t: [json.loads(x) for f in out.rglob(f"samples_{t}_*.jsonl") for x in f.read_text().splitlines()]
               for t in ("dflash_mc", "dflash_gen")}
    assert len(samples["dflash_mc"]) == 6 and len(samples["dflash_gen"]) == 3
    hf = hf_model(artifact(CASES["qwen3"])[0])
    worst, n_greedy = 0.0, 0
    for doc in samples["dflash_mc"]:
        for (ctx, cont), (ll, is_greedy) in zip(_args(doc), [r[0] for r in doc["resps"]], strict=True):
            ll, is_greedy = float(ll), is_greedy == "True"  # lm-eval logs them as text
            ids, n = [vocab[c] for c in ctx + cont], len(cont)
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
            rows = lp[len(ids) - n - 1 : len(ids) - 1]
            want = float(sum(rows[i, ids[len(ids) - n + i]] for i in range(n)))
            worst = max(worst, abs(ll - want))
            assert is_greedy == all(rows[i].argmax() == ids[len(ids) - n + i] for i in range(n))
            n_greedy += is_greedy
    print(f"lm-eval loglikelihoods vs transformers: worst |diff| {worst:.2e} over 18 choices ({n_greedy} greedy)")
    assert worst <= 1e-4 and n_greedy >= 2
    for doc in samples["dflash_gen"]:
        ctx = doc["arguments"]["gen_args_0"]["arg_0"]
        want = "".join(chars[t] for t in offline([vocab[c] for c in ctx], 8).tokens if not chars[t].startswith("<"))
        assert doc["resps"][0][0] == want.split("z")[0], (ctx, doc["resps"], want)


def _args(doc):
    a = doc["arguments"]
    return [(a[k]["arg_0"], a[k]["arg_1"]) for k in sorted(a, key=lambda k: int(k.rsplit("_", 1)[1]))]
