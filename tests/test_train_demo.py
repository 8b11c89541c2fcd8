"""The `demo` command: refuses a missing pair in one line; on a tiny pair (slow) it exports,
checks parity, decodes, and reports output identical to plain greedy decoding."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dflash_export.cli import cli
from dflash_export.train.config import parse_layer_ids
from dflash_export.train.data import default_taps


def test_layer_id_parsing_and_default_taps():
    assert parse_layer_ids("1,3,4") == [1, 3, 4]
    assert parse_layer_ids("1-3,5") == [1, 2, 3, 5]
    assert parse_layer_ids(None) is None
    assert default_taps(6) == [1, 2, 3, 4]
    assert default_taps(36) == [1, 9, 18, 26, 34]
    assert all(0 <= i < n for n in range(1, 40) for i in default_taps(n))


def test_demo_refuses_missing_pair(tmp_path):
    r = CliRunner().invoke(cli, ["demo", "--pair", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert r.output.startswith("error: the shipped pair is missing") and r.output.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_demo_table_fits_80_columns():
    """The result table at 80 columns: every line fits, no label or figure wraps inside its cell
    (each row's label is on one line with its figures), the notes below it say what [1]-[4] are."""
    from rich.console import Console

    from dflash_export.cli.demo import print_result

    split = {"prefill": 0.31, "draft": 1.2, "verify": 3.3, "host": 0.2, "total": 5.0}
    r = {"tokens_per_second": {"speculative": 1943.2, "autoregressive": 1601.0}, "tau": 14.66, "mean_verify_len": 15.1,
         "rounds": {"drafted": 16530, "plain": 11200}, "speedup": 11.57, "speedup_vs_best_plain": 10.5,
         "loop_efficiency": 1.004, "time_split_s": {"speculative": split, "autoregressive": split},
         "off_domain": {"prompts": 8, "tokens_per_second": {"speculative": 1580, "autoregressive": 1600}, "speedup": 0.97,
                        "tau": 2.1, "rounds": {"drafted": 30, "plain": 900}, "lossless": True},
         "lossless": True, "threads": 16, "best_plain_threads": 16, "block_size": 16, "speculation": "auto",
         "verify": {"theta": 0.05, "min_len": 3}}
    console = Console(width=80, record=True)
    print_result(console, r, 24, 128)
    lines = console.export_text().splitlines()
    assert lines and max(len(x) for x in lines) <= 80, max(lines, key=len)
    rows = [x for x in lines if x.startswith("│")]
    labels = ("tau (", "tokens/s (decode)", "speedup, same threads", "speedup, each at its best", "loop efficiency",
              "off-domain [4]: speedup", "output identical")
    for label in labels:  # one line each: label, DFlash figure, plain figure
        hits = [x for x in rows if label in x]
        assert len(hits) == 1 and hits[0].count("│") == 4, (label, hits)
    assert all(not x.strip("│ ").startswith(("(", "thread")) for x in rows)  # no wrapped continuation lines
    notes = "\n".join(x for x in lines if x.startswith("["))
    assert all(f"[{i}]" in notes for i in range(1, 5)) and "16 thread(s)" in notes and "random-vocabulary" in notes


@pytest.mark.slow
def test_demo_runs_on_tiny_pair(tmp_path):
    from dflash_export.models.tiny import make_drafter
    from train_fixtures import make_tokenized_target

    make_tokenized_target(tmp_path / "pair" / "target")
    make_drafter(tmp_path / "pair" / "draft", tmp_path / "pair" / "target", block_size=4, mask_token_id=1)
    r = CliRunner().invoke(cli, ["demo", "--pair", str(tmp_path / "pair"), "--out", str(tmp_path / "o"),
                                 "--prompt", "def f(x):\n", "--max-new-tokens", "16"])
    assert r.exit_code == 0, r.output
    assert "PASSED" in r.output and "output identical to plain greedy" in r.output
    assert (tmp_path / "o" / "artifact" / "manifest.json").is_file()


def test_num_prompts_and_the_deprecated_spelling(tmp_path):
    """--num-prompts N counts; --prompts N still does, with a warning (one release); --prompts FILE is a file of prompts."""
    from dflash_export.cli.demo import demo_prompts

    for args in (["--prompts", "3"], ["--num-prompts", "3"]):
        r = CliRunner().invoke(cli, ["demo", "--pair", str(tmp_path / "nothing"), *args])
        assert r.exit_code == 2 and "error: the shipped pair is missing" in r.output, r.output
        assert ("--prompts 3 is deprecated" in r.output and "use --num-prompts 3" in r.output) == (args[0] == "--prompts")
    r = CliRunner().invoke(cli, ["check", str(tmp_path / "nothing"), "--target", "t", "--draft", "d", "--prompts", "2"])
    assert r.exit_code == 2 and "use --num-prompts 2" in r.output, r.output
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    assert demo_prompts(None, 2, f) == ["a", "b"] and demo_prompts("x", 2, f) == ["x"]
    r = CliRunner().invoke(cli, ["check", str(tmp_path / "nothing"), "--target", "t", "--draft", "d", "--prompts", str(f)])
    assert r.exit_code == 2 and "not a directory" in r.output and "--num-prompts" not in r.output, r.output  # a file, read as one


def test_the_verify_policy_reads_as_words():
    from dflash_export.runtime.settings import VerifyPolicy, describe_policy, policy_json

    assert describe_policy(VerifyPolicy(theta=0.05, min_len=3)) == "confident prefix (theta 0.05, at least 3)"
    assert describe_policy(None) == describe_policy(VerifyPolicy()) == "full block"
    assert policy_json(VerifyPolicy(0.05, 3)) == {"theta": 0.05, "min_len": 3} and policy_json(None) == "full"
