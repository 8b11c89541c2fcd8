"""Benchmark of `dflash-export serve --ray` (Ray Serve) against the plain server, on one machine.

    .venv/bin/python bench/ray_serve.py                    # demo pair, 8 prompts, 64 tokens; writes bench/results/ray_serve.json

Runs itself inside a loopback-only network and pid namespace (unshare, as the tests), with a
local Ray head on 127.0.0.1 started through serve/ray.py local_head (as `serve --ray` does):
- per-request overhead at concurrency 1: the same streamed greedy requests through the plain
  server (`dflash-export serve`, 1 slot) and through Ray Serve (1 replica, 1 slot), interleaved,
  with `--max-tokens` new tokens and with 1 (the routing cost alone, median);
- aggregate tokens/s at concurrency 4 with 1 replica, then 2 replicas (same deployment, rescaled);
- idle resident memory (VmRSS) of the head's processes (GCS, raylet, agents, Serve controller and
  proxy, idle workers) and of each replica after it served requests.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, machine, parser

_spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
bench_serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_serve)


class RayServer(bench_serve.Server):
    def __init__(self, port: int):  # the Ray Serve proxy; the deployment is managed by the caller
        self.port = port


def rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def processes() -> dict[int, str]:
    out = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                out[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                pass
    return out


def name(cmdline: str) -> str:
    """A readable process name: the Ray actor title, or the script a python runs, or the binary."""
    argv = cmdline.split()
    if argv and argv[0].startswith("ray::"):
        return argv[0]
    if "python" not in Path(argv[0]).name:
        return Path(argv[0]).name
    script = next((Path(x).name for x in argv[1:] if x.endswith(".py")), None)
    return script or Path(argv[0]).name if argv else "?"


def aggregate(server, prompts, max_tokens, concurrency) -> dict:
    body = lambda p: {"prompt": p, "max_tokens": max_tokens, "temperature": 0}  # noqa: E731
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rs = list(pool.map(lambda p: server.post("/v1/completions", body(p)), prompts))
    wall = time.perf_counter() - t
    n = sum(len(r["tokens"]) for r in rs)
    return {"tokens": n, "wall_s": wall, "tokens_per_s": n / wall, "requests": len(rs)}


def inside(a) -> None:
    from ray import serve

    from dflash_export.serve import ray as serve_ray
    from dflash_export.serve.app import ServeOptions

    prompts = json.loads(Path(a.prompts_json).read_text())
    report: dict = {"artifact": str(a.artifact), "prompts": len(prompts), "max_tokens": a.max_tokens,
                    "machine": machine()}
    plain = bench_serve.Server(Path(a.artifact), "--slots", 1)
    t = time.perf_counter()
    serve_ray.local_head()
    report["head_start_s"] = time.perf_counter() - t
    serve.start(http_options={"host": "127.0.0.1", "port": 8000}, proxy_location="HeadOnly")
    options = ServeOptions(Path(a.artifact), model_name="bench", slots=1, max_queue=64)
    t = time.perf_counter()
    serve.run(serve_ray.build(options, replicas=1), name=serve_ray.APP, route_prefix="/", blocking=False)
    report["deploy_1_s"] = time.perf_counter() - t
    ray = RayServer(8000)
    body = lambda p: {"prompt": p, "max_tokens": a.max_tokens, "temperature": 0}  # noqa: E731
    for s in (plain, ray):
        for p in prompts[:2]:
            s.post("/v1/completions", body(p))  # warm-up
    # concurrency 1, interleaved: the same request through each, alternating which goes first
    pt, rt, ptok, rtok, same = [], [], 0, 0, True
    for rep in range(a.repeats):
        for i, p in enumerate(prompts):
            order = (plain, ray) if (i + rep) % 2 == 0 else (ray, plain)
            got = {id(s): s.post("/v1/completions", body(p)) for s in order}
            x, y = got[id(plain)], got[id(ray)]
            pt.append(x["total"])
            rt.append(y["total"])
            ptok += len(x["tokens"])
            rtok += len(y["tokens"])
            same &= x["tokens"] == y["tokens"]
    report["concurrency_1"] = {
        "requests": len(pt), "plain_mean_ms": 1e3 * sum(pt) / len(pt), "ray_mean_ms": 1e3 * sum(rt) / len(rt),
        "overhead_ms_per_request": 1e3 * (sum(rt) - sum(pt)) / len(pt),
        "plain_tokens_per_s": ptok / sum(pt), "ray_tokens_per_s": rtok / sum(rt), "same_tokens": same}
    # the per-request cost alone: 1-token requests (prefill + one token), interleaved
    one = {id(plain): [], id(ray): []}
    for i in range(3 * len(prompts)):
        for s in ((plain, ray) if i % 2 == 0 else (ray, plain)):
            one[id(s)].append(s.post("/v1/completions", {"prompt": prompts[i % len(prompts)], "max_tokens": 1,
                                                          "temperature": 0})["total"])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    report["one_token_requests"] = {"requests": len(one[id(plain)]), "plain_median_ms": 1e3 * med(one[id(plain)]),
                                    "ray_median_ms": 1e3 * med(one[id(ray)]),
                                    "overhead_median_ms": 1e3 * (med(one[id(ray)]) - med(one[id(plain)]))}
    procs = processes()
    replicas = [p for p, c in procs.items() if "ServeReplica:dflash" in c]
    head = {p: c for p, c in procs.items() if p not in replicas and p not in (1, os.getpid(), plain.proc.pid)
            and not c.startswith(("ss ", "bash"))}  # the namespace holds only this bench, its server and Ray
    report["idle_rss_mb"] = {
        "plain_server": rss(plain.proc.pid),
        "replica": [rss(p) for p in replicas],
        "head_total": sum(rss(p) for p in head),
        "head_processes": sorted(((name(c), round(rss(p), 1)) for p, c in head.items()), key=lambda x: -x[1]),
        "driver (this bench process)": rss(os.getpid()),
    }
    plain.stop()
    work = prompts * a.repeats
    report["aggregate_concurrency_4"] = {"1_replica": aggregate(ray, work, a.max_tokens, 4)}
    t = time.perf_counter()
    serve.run(serve_ray.build(options, replicas=2), name=serve_ray.APP, route_prefix="/", blocking=False)
    report["rescale_to_2_s"] = time.perf_counter() - t
    report["replicas_after_rescale"] = len([p for p, c in processes().items() if "ServeReplica:dflash" in c])
    aggregate(ray, prompts[:4], 8, 4)  # warm-up the new replica
    report["aggregate_concurrency_4"]["2_replicas"] = aggregate(ray, work, a.max_tokens, 4)
    serve.shutdown()
    Path(a.out).write_text(json.dumps(report, indent=1))


def main() -> None:
    ap = parser(__doc__, out="ray_serve.json", json_flag=False)
    ap.add_argument("--artifact", type=Path, help="exported directory [default: the demo pair, exported once]")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inside:
        return inside(a)
    from dflash_export.demo.artifact import demo_artifact

    art = (a.artifact or demo_artifact()).resolve()
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(x)["prompt"] for x in lines if x.strip()][: a.prompts]
    tmp = Path(tempfile.mkdtemp(prefix="dfb", dir="/tmp"))
    try:
        (tmp / "home").mkdir()
        (tmp / "rt").mkdir()
        out = tmp / "ray.json"
        (tmp / "prompts.json").write_text(json.dumps(prompts))
        args = [sys.executable, str(Path(__file__).resolve()), "--inside", "--artifact", str(art), "--max-tokens",
                str(a.max_tokens), "--repeats", str(a.repeats), "--out", str(out), "--prompts-json", str(tmp / "prompts.json")]
        cmd = "ip link set lo up && exec " + " ".join(map(_quote, args))
        env = os.environ | {"HOME": str(tmp / "home"), "RAY_TMPDIR": str(tmp / "rt"), "RAY_USAGE_STATS_ENABLED": "0"}
        subprocess.run(["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "bash", "-c", cmd],
                       env=env, check=True, timeout=1200)
        report = json.loads(out.read_text())
        a.out.write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


if __name__ == "__main__":
    main()
