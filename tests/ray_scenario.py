"""The Ray Serve scenario of tests/test_ray.py, run INSIDE a loopback-only network namespace
(`unshare --net --pid --fork --kill-child --mount-proc`; nothing can reach another address).

`python ray_scenario.py ART RESULT.json`: `dflash-export serve ART --ray` (a local head on
127.0.0.1, autoscaling 1..2 replicas, at most one per node) plus a worker node joined with
`ray start --block`; then under load: scale-up onto both nodes, a replica killed by pid,
scale-down, a corrupted artifact. Every request is bounded (socket timeout); every process
started here is stopped by its pid (and the namespace's init takes the rest with it).
Writes what it observed as JSON; the assertions are in test_ray.py.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_export.runtime.loop import generate
from dflash_export.runtime.ort.backend import OrtBackend

NO_TORCH = "import sys\nfor m in ('torch', 'onnx', 'onnxscript', 'transformers'): sys.modules[m] = None\n"
PORT, TIMEOUT, NEW = 8000, 30, 24
T0 = time.monotonic()


def say(*a):
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, file=sys.stderr, flush=True)


def request(ids: list[int], stream: bool, timeout: float = TIMEOUT) -> dict:
    """One greedy completion: {status, replica, tokens, done, error, body}; never raises, never hangs."""
    out = {"stream": stream, "status": None, "replica": None, "tokens": [], "done": False, "error": None}
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": ids, "max_tokens": NEW, "temperature": 0, "stream": stream, "cache_prompt": False}))
        r = conn.getresponse()
        out["status"], out["replica"] = r.status, r.getheader("x-dflash-replica")
        if r.status != 200 or not stream:
            raw = r.read()
            try:
                body = json.loads(raw)
                out["body"] = "json"
            except ValueError:
                body, out["body"] = None, raw[:200].decode(errors="replace")
            if r.status == 200:
                out["tokens"], out["done"] = body["choices"][0]["token_ids"], True
            elif isinstance(body, dict) and "error" in body:
                out["error"] = body["error"].get("message")
            return out
        for line in r:
            line = line.strip()
            if line == b"data: [DONE]":
                out["done"] = True
            elif line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if "error" in ev:
                    out["error"] = ev["error"]["message"]
                elif ev["choices"]:
                    out["tokens"] += ev["choices"][0]["token_ids"]
    except TimeoutError:
        out["error"] = "timeout"
    except (OSError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def replicas() -> list[int]:
    """Pids of the live Ray Serve replica processes (this pid namespace holds only our cluster)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if b"ServeReplica:dflash" in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return sorted(pids)


class Load:
    """`n` client threads sending greedy requests in a loop until stopped; every result kept."""

    def __init__(self, prompts, n: int):
        self.prompts, self.results, self.stop = prompts, [], threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int):
        rng = random.Random(i)
        while not self.stop.is_set():
            k = rng.randrange(len(self.prompts))
            r = request(self.prompts[k], stream=rng.random() < 0.5)
            r["prompt"], r["t"] = k, time.monotonic() - T0
            self.results.append(r)

    def end(self):
        self.stop.set()
        for t in self.threads:
            t.join(TIMEOUT + 5)
        return [t.name for t in self.threads if t.is_alive()]


def wait(cond, timeout: float, step: float = 0.25):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(step)
    return None


def classify(r: dict, want: list[list[int]]) -> str:
    if r["status"] == 200 and r["done"] and r["error"] is None:
        return "ok" if r["tokens"] == want[r["prompt"]] else "wrong"
    if r["error"] == "timeout":
        return "hang"
    if r["status"] is not None and r["status"] >= 500 and r.get("body") == "json":
        return "json_5xx"
    if r["status"] is not None and r["status"] >= 500:
        return "other_5xx"
    if r["status"] == 200 and r["stream"] and not r["done"]:
        return "stream_cut"  # started, then ended without data: [DONE]
    return "lost"


def node(r: dict) -> str | None:
    """HOST@NODE of a response's x-dflash-replica (None for "-": Ray's own errors, no replica)."""
    parts = (r.get("replica") or "-").split("/")
    return parts[0] if len(parts) == 3 else None


def pid(r: dict) -> int | None:
    parts = (r.get("replica") or "-").split("/")
    return int(parts[1]) if len(parts) == 3 else None


def main(art: Path, result: Path) -> None:
    res: dict = {}
    env = os.environ | {"PYTHONPATH": ""}
    cli = subprocess.Popen(
        [sys.executable, "-c", NO_TORCH + "from dflash_export.cli import cli\ncli(sys.argv[1:])\n", "serve", str(art),
         "--ray", "--port", str(PORT), "--autoscale", "1:2", "--max-replicas-per-node", "1", "--upscale-delay", "1",
         "--downscale-delay", "2", "--health-check-period", "0.5", "--max-queue", "8", "--max-batch", "2", "--shutdown-timeout", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(x) for x in cli.stderr], daemon=True).start()
    ready: list[str] = []
    threading.Thread(target=lambda: [ready.append(x) for x in cli.stdout], daemon=True).start()
    worker = None
    try:
        rng = random.Random(0)  # the expected outputs, computed while the head starts
        prompts = [[rng.randrange(99) for _ in range(rng.randint(3, 20))] for _ in range(12)]
        backend = OrtBackend(art, threads=1)
        want = [generate(backend, p, NEW).tokens for p in prompts]
        backend.close()
        say("expected outputs computed")
        head = wait(lambda: next((m.group(1) for x in lines if (m := re.search(r"local Ray head at (\S+)", x))), None), 150)
        assert head, "no Ray head in 150 s:\n" + "".join(lines[-30:])
        say("head", head)
        worker = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--address", head, "--node-ip-address", "127.0.0.1",
             "--num-cpus", "1", "--object-store-memory", str(80 << 20), "--disable-usage-stats", "--block"],
            stdout=open(result.with_suffix(".worker.log"), "w"), stderr=subprocess.STDOUT,
            env=env | {"RAY_AUTH_MODE": "token"})  # the head's token: $HOME/.ray/auth_token
        assert wait(lambda: any("ready at" in x for x in ready), 150), "not ready in 150 s:\n" + "".join(lines[-30:])
        res["ready_s"] = time.monotonic() - T0
        say("ready")
        res["listening"] = subprocess.run(["ss", "-Hltnup"], capture_output=True, text=True).stdout.split("\n")

        # 1. one replica at first; the same outputs as `generate`, plain and streamed
        res["initial_replicas"] = replicas()
        res["sequential"] = [classify(dict(request(p, s), prompt=k), want) for k, p in enumerate(prompts[:4])
                             for s in (False, True)]

        # 2. sustained load: autoscaling to 2 replicas, on different nodes (4 clients keep 4 requests
        # ongoing: twice the target of 2 per replica (--max-batch 2: two batch rows each), so 2 replicas)
        load = Load(prompts, 4)
        both = wait(lambda: len({node(r) for r in load.results[-8:] if r["status"] == 200}) == 2, 90)
        res["scale_up_s"] = time.monotonic() - T0 - res["ready_s"]
        res["up_replicas"] = replicas()
        say("two nodes" if both else "NOT two nodes", res["up_replicas"])

        # 3. kill one replica by pid mid-load; Ray brings a new one
        seen = {pid(r) for r in load.results if r["status"] == 200}
        victim = max(res["up_replicas"]) if len(res["up_replicas"]) == 2 else None
        res["victim"] = victim
        kill_at = len(load.results)
        if victim:
            os.kill(victim, signal.SIGKILL)
            say("killed", victim)
        back = wait(lambda: [p for p in replicas() if p not in seen and p != victim], 60)
        res["replacement"] = back
        served = wait(lambda: any(pid(r) in (back or []) and r["status"] == 200 for r in load.results), 60) if back else None
        res["replacement_served"] = bool(served)
        say("replacement", back, "served", bool(served))
        hung = load.end()
        say("load ended")
        res["hung_threads"] = hung
        res["load"] = [classify(r, want) for r in load.results[:kill_at]]
        res["after_kill"] = [classify(r, want) for r in load.results[kill_at:]]
        res["load_nodes"] = sorted({node(r) for r in load.results if node(r)})
        res["not_ok"] = [{k: r.get(k) for k in ("status", "stream", "error", "body", "done", "replica", "t")}
                         for r in load.results if classify(r, want) != "ok"][:20]
        res["load_errors"] = sorted({str(r["error"]) + " " + str(r.get("body")) for r in load.results if r["error"]})[:10]

        # 4. no load: back down to one replica
        down = wait(lambda: len(replicas()) == 1, 60)
        res["scale_down_s"] = time.monotonic() - T0 if down else None
        res["down_replicas"] = replicas()
        say("down", res["down_replicas"])

        # 5. a corrupted artifact: the health check fails (503 from then on), new replicas refuse to serve
        f = art / "tokenizer.json"
        good = f.read_bytes()
        f.write_bytes(good + b" ")
        mark = len(lines)
        t = time.monotonic()
        res["bad_first"] = wait(lambda: (lambda r: r if r["status"] != 200 else None)(request(prompts[0], False)), 30)
        res["bad_after_s"] = time.monotonic() - t
        say("bad artifact answered", (res["bad_first"] or {}).get("status"))
        logs = Path(os.environ["RAY_TMPDIR"]) / "ray" / "session_latest" / "logs" / "serve"

        def refusals():
            return [x for f in logs.glob("replica_*.log") for x in f.read_text(errors="replace").splitlines()
                    if "refusing to serve" in x and "does not match its sha256" in x]

        refused = wait(refusals, 60)
        say("refused" if refused else "NOT refused")
        res["bad_log"] = (refused or [])[:2] + [x.strip() for x in lines[mark:] if "refusing to serve" in x][:2]
        with ThreadPoolExecutor(2) as pool:  # side by side: each may wait its full 5 s for a replica
            res["bad_requests"] = list(pool.map(lambda _: request(prompts[0], False, timeout=5), range(2)))
        f.write_bytes(good)
        say("restored the file")
        t = time.monotonic()
        res["restored"] = bool(wait(lambda: request(prompts[0], False)["tokens"] == want[0], 90, step=1))
        res["restored_s"] = time.monotonic() - t
        say("restored", res["restored"])
    except Exception:  # reported by the tests (a missing observation names this)
        import traceback

        res["error"] = traceback.format_exc()
        raise
    finally:
        cli.send_signal(signal.SIGTERM)
        try:
            res["cli_rc"] = cli.wait(60)
            say("cli exited", res["cli_rc"])
        except subprocess.TimeoutExpired:
            res["cli_rc"] = "timeout"
            cli.kill()
            cli.wait(10)
        if worker is not None:  # SIGTERM makes it drain for up to 30 s; nothing to drain once the head is gone
            worker.kill()
            worker.wait(10)  # the namespace ends the raylet and its workers with this process
        res["log_tail"] = [x.rstrip() for x in lines[-40:]]
        res["total_s"] = time.monotonic() - T0
        result.write_text(json.dumps(res, indent=1))
        say("done")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
