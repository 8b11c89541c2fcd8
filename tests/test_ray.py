"""`dflash-export serve --ray`: the server as a Ray Serve application.

One real two-node Ray cluster for the whole module (about 2.5 min here), inside a
loopback-only network namespace: tests/ray_scenario.py runs there and reports what it saw;
the tests below check it. Plus the pieces that need no cluster (flags, config file, the
proxy's JSON errors). Ray is the `ray` extra, installed by `make setup`; without it, or
without a loopback-only namespace (`unshare`, `ip`), the cluster tests skip with the reason
printed in the summary (a cluster must never start on a real network), except under CI=true,
where they fail: CI's machines can make namespaces, and these tests are the proof of scale-out.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from runtime_cases import CASES, artifact
from test_runtime_cli import char_tokenizer

from dflash_export.cli import cli
from dflash_export.runtime import manifest as M

ROOT = Path(__file__).resolve().parents[1]


CI = os.environ.get("CI") == "true"


def _missing(reason: str):
    if CI:
        pytest.fail(f"{reason} (CI=true: the Ray tests must run, not skip)")
    pytest.skip(reason)


try:
    from dflash_export.serve import ray as serve_ray
except ImportError as e:  # the ray extra
    serve_ray = None
    _why = f"ray[serve] is not installed ({e}); pip install -e '.[ray]'"


@pytest.fixture(scope="module")
def sr():
    if serve_ray is None:
        _missing(_why)
    return serve_ray


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray") / "tiny"
    shutil.copytree(artifact(CASES["qwen3"])[2], d)
    char_tokenizer(d / "tokenizer.json")
    m = M.load_manifest(d, verify=False)
    m.tokenizer = True
    M.write_manifest(d, m)
    return d


@pytest.fixture(scope="module")
def run(sr, art):
    """The scenario's observations (one cluster: head + worker, in its own net and pid namespace)."""
    ns = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if shutil.which("unshare") is None:
        _missing("unshare is not installed (util-linux)")
    probe = subprocess.run(ns + ["bash", "-c", "ip link set lo up"], capture_output=True, text=True)
    if probe.returncode != 0:
        _missing(f"cannot create a loopback-only namespace here: {probe.stderr.strip() or probe.returncode}")
    tmp = Path(tempfile.mkdtemp(prefix="dfr", dir="/tmp"))  # short: Ray's unix socket paths have a length limit
    try:
        (tmp / "home").mkdir()
        (tmp / "rt").mkdir()
        env = os.environ | {"HOME": str(tmp / "home"), "RAY_TMPDIR": str(tmp / "rt"), "RAY_USAGE_STATS_ENABLED": "0",
                            "PYTHONPATH": ""}
        out = tmp / "result.json"
        cmd = f"ip link set lo up && exec {sys.executable} {ROOT / 'tests' / 'ray_scenario.py'} {art} {out}"
        p = subprocess.run(ns + ["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=480)
        assert out.is_file(), f"the scenario wrote nothing (exit {p.returncode}):\n{p.stderr[-4000:]}"
        res = Observed(json.loads(out.read_text()))
        print(p.stderr[-3000:])
        res["stderr"] = p.stderr[-6000:]
        yield res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Observed(dict):
    """The scenario's observations; a missing one fails with the scenario's error and log."""

    def __missing__(self, key):
        pytest.fail(f"the scenario did not get to {key!r}:\n{self.get('error', '')}\n{_where(self)}")


def _where(res) -> str:
    return "\n".join(res.get("log_tail", [])[-25:]) + "\n" + res.get("stderr", "")[-2000:]


def test_listens_on_loopback_only(run):
    addrs = [line.split()[4] for line in run["listening"] if line.strip()]
    assert addrs, _where(run)
    bad = [a for a in addrs if not a.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")]
    assert not bad, bad
    assert any(a.endswith(":8000") for a in addrs)  # the HTTP proxy


def test_outputs_equal_generate_from_both_nodes(run):
    assert run["sequential"] == ["ok"] * 8, _where(run)  # 4 prompts, plain and streamed
    assert len(run["load_nodes"]) == 2, (run["load_nodes"], _where(run))  # x-dflash-replica: HOST@NODE/PID/SLOT
    assert run["load"] and set(run["load"]) == {"ok"}, Counter(run["load"])  # greedy == generate, token for token


def test_autoscaling_up_and_down(run):
    assert len(run["initial_replicas"]) == 1 and len(run["up_replicas"]) == 2, _where(run)
    assert run["down_replicas"] and len(run["down_replicas"]) == 1, _where(run)
    print(f"scale-up {run['scale_up_s']:.1f} s after load began")


def test_replica_killed_mid_load(run):
    assert run["victim"] in run["up_replicas"], _where(run)
    seen = Counter(run["after_kill"])
    print(f"after the kill: {dict(seen)} (not ok: {run['not_ok']})")
    assert not run["hung_threads"]
    assert seen["hang"] == seen["lost"] == seen["wrong"] == seen["other_5xx"] == 0, (seen, run["not_ok"])
    assert set(seen) <= {"ok", "json_5xx", "stream_cut"} and seen["ok"] > 0
    assert run["replacement"] and run["replacement_served"], _where(run)  # Ray started a new one; it serves


def test_bad_artifact_is_refused(run):
    first = run["bad_first"]
    assert first and first["status"] == 503 and first["body"] == "json", first
    assert "refusing to serve" in first["error"] and "changed on disk" in first["error"]
    assert any("does not match its sha256" in x for x in run["bad_log"]), run["bad_log"]  # a new replica's log line
    assert all(r["status"] != 200 for r in run["bad_requests"]), run["bad_requests"]
    assert run["restored"], _where(run)


def test_cli_stops_cleanly(run):
    assert run["cli_rc"] == 0, _where(run)


# -- without a cluster ----------------------------------------------------------------------------


def test_ray_flags_are_one_line(sr, art):
    r = CliRunner()
    for args, msg in (
        (["--replicas", "2"], "--replicas needs --ray"),
        (["--ray", "--replicas", "2", "--autoscale", "1:2"], "not both"),
        (["--ray", "--autoscale", "3:1"], "MIN:MAX"),
        (["--ray", "--autoscale", "x"], "MIN:MAX"),
        (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
        (["--ray", "--max-ongoing", "5", "--max-queue", "8"], "--max-ongoing must be > rows + queue = 12"),  # 4 rows by default
        (["--ray", "--max-ongoing", "5", "--max-queue", "8", "--slots", "1"], "--max-ongoing must be > rows + queue = 9"),
    ):
        res = r.invoke(cli, ["serve", str(art), *args])
        assert res.exit_code != 0 and msg in res.output and "Traceback" not in res.output, (args, res.output)


def test_deployment_options(sr, art):
    from dflash_export.serve.app import ServeOptions

    o = ServeOptions(art, slots=2, max_queue=4)
    d = sr.build(o, replicas=3, num_gpus=1)._bound_deployment  # no public accessor in Ray 2.60
    assert d.num_replicas == 3 and d.max_ongoing_requests == 2 + 4 + sr.HEADROOM
    assert d.ray_actor_options["num_gpus"] == 1
    a = sr.build(o, autoscale=(1, 4), upscale_delay=2, downscale_delay=5)._bound_deployment._deployment_config.autoscaling_config
    assert (a.min_replicas, a.max_replicas, a.target_ongoing_requests, a.upscale_delay_s, a.downscale_delay_s) == \
        (1, 4, 2, 2, 5)
    b = sr.build(ServeOptions(art, max_batch=3, max_queue=4), autoscale=(1, 2))._bound_deployment  # batch rows count
    assert b.max_ongoing_requests == 3 + 4 + sr.HEADROOM and b._deployment_config.autoscaling_config.target_ongoing_requests == 3


def test_config_file(sr, art):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    cfg = yaml.safe_load((ROOT / "deploy" / "ray-serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(cfg)
    assert schema.http_options.host == "127.0.0.1"
    app = schema.applications[0]
    assert app.import_path == "dflash_export.serve.ray:app_builder"
    dep = app.deployments[0]
    rows = max(app.args.get("max_batch", 1), app.args.get("slots", 1))
    assert dep.name == sr.APP and dep.autoscaling_config["target_ongoing_requests"] == rows
    assert dep.max_ongoing_requests > rows + app.args["max_queue"]
    built = sr.app_builder(app.args | {"directory": str(art)})
    assert built is not None
    with pytest.raises(Exception, match="directory"):
        sr.app_builder({"slots": 1})


def test_proxy_errors_become_json(sr):
    async def call(app):
        sent = []

        async def receive():
            return {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)

        await sr.JsonErrors(app)({"type": "http"}, receive, send)
        return sent

    async def silent(scope, receive, send):  # Ray's proxy when the replica died before answering
        return None

    async def text500(scope, receive, send):
        await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    for app, reason in ((silent, "before a response started"), (text500, "Internal Server Error")):
        start, body = asyncio.run(call(app))
        assert start["status"] == 500 and (b"content-type", b"application/json") in start["headers"]
        err = json.loads(body["body"])["error"]
        assert reason in err["message"] and err["type"] == "server_error"
    sent = asyncio.run(call(stream))
    assert [m.get("status") for m in sent] == [200, None, None] and sent[1]["body"] == b"data: x\n\n"


def test_plain_server_never_imports_ray():
    code = ("import sys\nfrom dflash_export import cli\nfrom dflash_export.cli import serve as cmd_serve\nfrom dflash_export.serve import app, engine\n"
            "from click.testing import CliRunner\nCliRunner().invoke(cli.cli, ['serve', '--help'])\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
