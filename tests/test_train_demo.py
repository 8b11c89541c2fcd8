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
    """--num-prompts N counts; --prompts N still does, with a warning (one release); --prompts FILE is a file."""
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
    assert r.exit_code == 2 and "give their number with --num-prompts N" in r.output, r.output


def test_the_verify_policy_reads_as_words():
    from dflash_export.runtime.settings import VerifyPolicy, describe_policy, policy_json

    assert describe_policy(VerifyPolicy(theta=0.05, min_len=3)) == "confident prefix (theta 0.05, at least 3)"
    assert describe_policy(None) == describe_policy(VerifyPolicy()) == "full block"
    assert policy_json(VerifyPolicy(0.05, 3)) == {"theta": 0.05, "min_len": 3} and policy_json(None) == "full"
