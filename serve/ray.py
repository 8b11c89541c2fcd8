"""`dflash-export serve OUT --ray`: the server's own app as a Ray Serve deployment.

Every replica is one process holding one engine (`load_engine`) and serving the very app of
the single-process server (`create_app(options, engine=...)`) behind Ray Serve's HTTP proxy:
same routes, bodies, streaming, 429 queue and errors. Ray adds placement across nodes,
restarts of dead replicas and autoscaling on ongoing requests.

Artifacts: every replica opens `options.directory` itself, so that path must hold the same
exported directory on every node (a shared filesystem, or the same copy at the same path).
The replica verifies it against the manifest's sha256 before serving; a mismatch is a
`refusing to serve` log line and a failed constructor, so Ray never routes to it. Its health
check re-checks the files' size and mtime (cheap) and fails the same way if they changed.

Nothing here is imported by the single-process server (`ray` is the `ray` extra).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import click
import ray
from ray import serve
from ray.serve._private import replica as ray_replica
from starlette.middleware import Middleware

from . import jobs as serve_jobs
from ..runtime import manifest as M
from ..runtime.errors import DFlashError
from .app import REPLICA, create_app
from .engine import load_engine
from .options import ServeOptions

APP = "dflash"  # the application and deployment name (also in deploy/ray-serve.yaml)
HEADROOM = 8  # max_ongoing_requests beyond slots + queue: /health, /metrics and the requests answered 429
log = logging.getLogger("ray.serve")


def _stamp(directory: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every listed file: what the health check compares with the verified state."""
    m = M.load_manifest(directory, verify=False)
    out = {}
    for rel in sorted(m.files):
        try:
            st = (Path(directory) / rel).stat()
            out[rel] = (st.st_size, st.st_mtime_ns)
        except OSError:
            out[rel] = (-1, -1)
    return out


def _refuse(message: str) -> RuntimeError:
    line = f"dflash-export replica {serve_jobs.replica()}: refusing to serve: {message}"
    log.error(line)
    print(line, file=sys.stderr, flush=True)
    return RuntimeError(line)


class JsonErrors:
    """ASGI middleware in the Ray Serve proxy: Ray's own 5xx answers (plain text, e.g. when a
    replica died during the request) become the server's JSON error body, as every other error."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held, text, started = None, b"", False

        async def error(status: int, reason: str):
            nonlocal started
            started = True
            body = json.dumps({"error": {"message": f"Ray Serve answered {status}: {reason}",
                                         "type": "server_error" if status != 503 else "service_unavailable",
                                         "param": None, "code": "ray_serve"}}).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (REPLICA.encode(), b"-")]})
            await send({"type": "http.response.body", "body": body})

        async def send_json_errors(message):
            nonlocal held, text, started
            if message["type"] == "http.response.start":
                ctype = dict((k.lower(), v) for k, v in message.get("headers", [])).get(b"content-type", b"")
                if message["status"] >= 500 and not ctype.startswith(b"application/json"):
                    held = message
                    return
                started = True
            elif held is not None and message["type"] == "http.response.body":
                text += message.get("body", b"")
                if message.get("more_body"):
                    return
                return await error(held["status"], text.decode(errors="replace").strip()[:200] or "no details")
            await send(message)

        try:
            await self.app(scope, receive, send_json_errors)
        except Exception as e:  # before the response started: a JSON 500; after (a stream): the connection ends
            if started or held is not None:
                raise
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            await error(500, f"{type(e).__name__}: {first}")
            return
        if not started:  # Ray's proxy returns without a response when the replica died first (uvicorn: text 500)
            await error(500, "the request failed before a response started (the replica may have died); retry it")


def proxy_middlewares() -> list:
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=dflash_export.serve.ray:proxy_middlewares (set by `run`)."""
    return [Middleware(JsonErrors)]


def _loopback_grpc() -> None:
    """Ray Serve 2.60 replicas open an inter-deployment gRPC server on [::]:0 (every interface)
    whatever the node IP; on a loopback-only cluster (node IP 127.0.0.1) bind it to 127.0.0.1."""
    add = ray_replica.add_port_to_grpc_server
    if getattr(add, "loopback", False):
        return

    def loopback(server, address: str):
        return add(server, address.replace("[::]:", "127.0.0.1:", 1))

    loopback.loopback = True
    ray_replica.add_port_to_grpc_server = loopback


@serve.ingress()
class DFlashReplica:
    """One replica: verify and load the artifact, then serve `create_app` over that engine."""

    def __init__(self, options: ServeOptions):
        node = ray.get_runtime_context().get_node_id()
        if ray.util.get_node_ip_address() == "127.0.0.1":
            _loopback_grpc()
        serve_jobs.NODE = f"{socket.gethostname()}@{node[:8]}"  # several Ray nodes may share a host (replica())
        self.options = options
        try:  # OrtBackend hashes every listed file against the manifest before loading
            self.stamp = _stamp(options.directory)
            self.engine = load_engine(options)
        except DFlashError as e:
            raise _refuse(str(e)) from None
        log.info(f"dflash-export replica {serve_jobs.replica()}: serving {options.directory} (verified)")

    def __serve_build_asgi_app__(self):
        self.asgi = create_app(self.options, engine=self.engine)
        return self.asgi

    def check_health(self) -> None:
        """Ray calls this every health_check_period_s; raising makes Ray replace the replica
        (after a few failures); until then every request gets a 503 naming the problem."""
        holder = self.asgi.state.holder
        if self.engine.stopping or holder.error is not None:
            if holder.error is not None:
                raise RuntimeError(holder.error)
            return
        problem = None
        if _stamp(self.options.directory) != self.stamp:
            problem = f"{self.options.directory} changed on disk since it was verified; restarting to re-verify"
        elif dead := [t.name for t in self.engine.threads if not t.is_alive()]:
            problem = f"slot threads stopped: {', '.join(dead)}"
        if problem:
            e = _refuse(problem)
            holder.error, holder.engine = str(e), None  # /health and every route: 503 with this message
            raise e


def build(options: ServeOptions, *, replicas: int | None = 1, autoscale: tuple[int, int] | None = None,
          num_cpus: float = 1.0, num_gpus: float = 0.0, max_ongoing: int | None = None,
          max_replicas_per_node: int | None = None, upscale_delay: float = 30.0, downscale_delay: float = 600.0,
          health_period: float = 10.0, shutdown_timeout: float = 10.0) -> serve.Application:
    """The Ray Serve application: `replicas` fixed, or autoscaled in [MIN, MAX] on ongoing requests."""
    least = options.rows + options.max_queue
    max_ongoing = least + HEADROOM if max_ongoing is None else max_ongoing
    if max_ongoing < least + 1:
        raise DFlashError(f"--max-ongoing must be > rows + queue = {least} (got {max_ongoing}) so that the "
                          "server's own queue, not Ray's, decides when to answer 429")
    if replicas is not None and replicas < 1:
        raise DFlashError(f"--replicas must be >= 1 (got {replicas})")
    cfg = dict(max_ongoing_requests=max_ongoing, health_check_period_s=health_period, health_check_timeout_s=30,
               graceful_shutdown_timeout_s=shutdown_timeout, graceful_shutdown_wait_loop_s=0.5,
               ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    if max_replicas_per_node is not None:
        cfg["max_replicas_per_node"] = max_replicas_per_node
    if autoscale is None:
        if replicas is not None:  # None: from a config file's deployments section (serve run)
            cfg["num_replicas"] = replicas
    else:
        lo, hi = autoscale
        if not 1 <= lo <= hi:
            raise DFlashError(f"--autoscale MIN:MAX needs 1 <= MIN <= MAX (got {lo}:{hi})")
        cfg["autoscaling_config"] = {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
            "target_ongoing_requests": options.rows,  # a replica is "full" when its rows (or slots) are busy
            "upscale_delay_s": upscale_delay, "downscale_delay_s": downscale_delay,
            # deprecated since Ray 2.60 but still what its replicas and routers push metrics by;
            # a future Ray replaces it with RAY_SERVE_{REPLICA,HANDLE}_AUTOSCALING_METRIC_PUSH_INTERVAL_S
            "metrics_interval_s": min(10.0, max(0.5, upscale_delay / 2)),
            "look_back_period_s": min(30.0, max(1.0, upscale_delay)),
        }
    return serve.deployment(DFlashReplica, name=APP).options(**cfg).bind(options)


def app_builder(args: dict) -> serve.Application:
    """`serve run deploy/ray-serve.yaml`: `args` are ServeOptions fields (`directory` required);
    replicas, autoscaling, resources come from the config's `deployments` section."""
    args = dict(args)
    if "directory" not in args:
        raise DFlashError("the application's args need 'directory': the exported directory (same path on every node)")
    options = ServeOptions(Path(args.pop("directory")), **args)
    M.load_manifest(options.directory, verify=False)
    return build(options, replicas=None)


def _rows(options: ServeOptions) -> str:
    return f"batch {options.max_batch}" if options.max_batch > 1 else f"{options.slots} slot(s)"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ray_env() -> None:
    """Settings the cluster's processes inherit (so set before a local head starts; on a cluster
    started elsewhere, set them where `ray start --head` runs: docs/ray.md)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # the proxy (head only) routes to every node's replicas instead of preferring its own node's
    # (which would leave the other nodes idle until the head's replicas are full)
    os.environ.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "dflash_export.serve.ray:proxy_middlewares")
    # the proxy imports that module (numpy, the serve app) before it reports ready; on a loaded 2-vCPU box
    # that took longer than Ray's 5 s ready check, the controller killed the proxy and serve.start failed
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")


def local_head() -> str:
    """Start a Ray head on 127.0.0.1 (no dashboard, a small object store) owned by this process; its GCS address."""
    ray_env()
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             object_store_memory=int(os.environ.get("DFLASH_RAY_OBJECT_STORE", 100 << 20)), configure_logging=False)
    return ray.get_runtime_context().gcs_address


def run(options: ServeOptions, *, host: str, port: int, address: str | None, proxy: str, **deploy) -> None:
    """Deploy on a Ray cluster (`address`) or on a local head bound to 127.0.0.1; serve until SIGINT/SIGTERM."""
    application = build(options, **deploy)  # bad flags are one line before anything starts
    if port == 0:
        port = _free_port(host)
    stop = threading.Event()
    try:
        if address is None:
            gcs = local_head()
            click.echo(f"dflash-export serve: started a local Ray head at {gcs} (stopped on exit); more nodes on this "
                       f"machine join with: RAY_AUTH_MODE=token ray start --address {gcs} "
                       "--node-ip-address 127.0.0.1", err=True)
        else:
            ray.init(address=address, configure_logging=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        serve.start(http_options={"host": host, "port": port}, proxy_location=proxy)
        serve.run(application, name=APP, route_prefix="/", blocking=False)
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        how = (f"autoscaling {deploy['autoscale'][0]}..{deploy['autoscale'][1]} replicas" if deploy.get("autoscale")
               else f"{deploy.get('replicas', 1)} replica(s)")
        click.echo(f"dflash-export serve: ready at {url}  model {options.model!r} on Ray Serve, {how}, "
                   f"{_rows(options)} and queue {options.max_queue} each")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
        click.echo("dflash-export serve: stopping the Ray Serve application ...", err=True)
        serve.delete(APP)
        if address is None:
            serve.shutdown()
    except RuntimeError as e:  # serve.run: a deployment that failed to start (e.g. a bad artifact)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DFlashError(f"the Ray Serve deployment failed: {first}") from None
    finally:
        if ray.is_initialized():
            ray.shutdown()  # a local head started above stops here (only the processes it started)
    click.echo("dflash-export serve: stopped", err=True)
