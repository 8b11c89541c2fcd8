"""`dflash-export serve`: the OpenAI-compatible server (uvicorn over serve/app.py create_app).

The process binds its socket first (so `--port 0` can print the port it got), answers
/health with 503 while the model loads in the background, prints the URL when ready, and
on Ctrl-C / SIGTERM stops accepting, lets in-flight requests finish for up to
--shutdown-timeout seconds, then cancels the rest (a stream ends with an error event, a
waiting or non-streamed request gets a 503) and exits 0; a second Ctrl-C cancels at once.
torch is never imported here: `--demo` exports the shipped pair in a child process (which needs the export extra).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from pathlib import Path

import click

from .options import field_options, resolve_speculation
from ..runtime import contract as C, manifest as M
from ..demo.artifact import demo_artifact
from ..runtime.errors import DFlashError
from ..runtime.files import read_text
from ..runtime.lazy import installed, lazy_import
from ..runtime.load import settings_for
from ..runtime.memory import check_cache_memory
from ..serve.options import RayOptions, ServeOptions

DEFAULT_BATCH = 4  # rows per round when --max-batch is not given (docs/serve.md: measured)

uvicorn = lazy_import("uvicorn")  # the serve extra, only when a server starts
serve_app = lazy_import("dflash_export.serve.app")
serve_ray = lazy_import("dflash_export.serve.ray")


def _need_serve_extra() -> None:
    missing = []
    for mod in ("fastapi", "uvicorn", "pydantic", "prometheus_client", "jinja2", "llguidance"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise DFlashError(f"serve needs {', '.join(missing)}: pip install \"dflash-export[serve]\"")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DFlashError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port (0: any free port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _engine_batch(m) -> int:
    """The largest batch the TensorRT engines were built for (`build --max-batch`; 0: no engines)."""
    return int(m.engines.get("max_batch", 1)) if m.engines else 0


def _batch_rows(directory, m, max_batch: int | None, slots: int | None, backend: str, provider: str,
                drafter: bool) -> tuple[int, int]:
    """(max_batch, slots): --max-batch batches rows in one loop, --slots runs a loop per slot.
    Neither: batch DEFAULT_BATCH rows where the export, backend and memory allow it (fewer
    when only fewer fit; TensorRT: up to the engines' batch), else one slot. An explicit batch
    that does not fit is refused."""
    if max_batch is not None and slots is not None and max_batch > 1 and slots > 1:
        raise DFlashError(f"give --max-batch {max_batch} or --slots {slots}, not both")
    trt = backend == "trt"
    batchable = C.ragged(m) and (provider == "cpu" if backend == "ort" else _engine_batch(m) > 1)
    if max_batch is None:
        if slots is not None or not batchable:
            return 1, slots or 1
        if trt:  # device memory: the engines' batch was sized at build time
            return min(DEFAULT_BATCH, _engine_batch(m)), 1
        for b in range(DEFAULT_BATCH, 1, -1):
            try:
                check_cache_memory(m, b, m.max_context, drafter)
                return b, 1
            except DFlashError:
                continue
        return 1, 1
    if max_batch > 1:
        if backend == "ort" and provider != "cpu":
            raise DFlashError(f"--max-batch {max_batch} runs on ONNX Runtime's CPU provider (its batched caches are "
                              "host arrays); on an NVIDIA GPU serve with --backend trt and engines from `dflash-export "
                              f"build OUT --max-batch {max_batch}`, or use --provider cpu, or --max-batch 1")
        if not C.ragged(m):
            raise DFlashError(f"{directory} was exported before batched decoding; re-export it with this dflash-export "
                              "to use --max-batch > 1, or serve it with --max-batch 1")
        if trt:
            built = _engine_batch(m)
            if not built:
                raise DFlashError(f"{directory} has no TensorRT engines; build them for --max-batch {max_batch} with "
                                  f"`dflash-export build {directory} --max-batch {max_batch}`")
            if built < max_batch:
                rows = "batch 1 only" if built == 1 else f"batch 1..{built}"
                raise DFlashError(f"--max-batch {max_batch} but the TensorRT engines in {directory} were built for "
                                  f"{rows}; rebuild them with `dflash-export build {directory} --max-batch {max_batch}`"
                                  f", or serve with --max-batch {built}")
            return max_batch, slots or 1
        try:
            check_cache_memory(m, max_batch, m.max_context, drafter)
        except DFlashError as e:
            raise DFlashError(str(e).replace("--batch", "--max-batch")) from None
    return max_batch, slots or 1


def _api_key(api_key: str | None, api_key_file: Path | None) -> str | None:
    """--api-key (or DFLASH_API_KEY), or the key read from --api-key-file."""
    if api_key and api_key_file:
        raise DFlashError("give --api-key or --api-key-file, not both")
    if api_key_file is None:
        return api_key
    api_key = read_text(api_key_file, what="--api-key-file ").strip()
    if not api_key:
        raise DFlashError(f"--api-key-file {api_key_file} is empty")
    return api_key


def _template(path: Path | None) -> str | None:
    """--chat-template's text (the record holds the template, not its file)."""
    if path is None:
        return None
    return read_text(path, "give a Jinja template file", what="--chat-template ")


@click.command()
@click.argument("out", required=False, type=click.Path(path_type=Path))
@click.option("--demo", is_flag=True, help="Serve the shipped demo pair (exported once into ~/.cache/dflash-export/).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (other than loopback: set an API key).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port (0-65535); 0 picks a free one (printed).")
@field_options(ServeOptions)
@click.option("--api-key-file", type=click.Path(path_type=Path), help="Read the API key from this file.")
@click.option("--shutdown-timeout", default=10.0, show_default=True, type=float,
              help="Seconds in-flight requests may finish after Ctrl-C / SIGTERM before they are cancelled.")
@field_options(RayOptions, into="ray")
def serve(out, demo, host, port, api_key_file, shutdown_timeout, ray: RayOptions, **fields):
    """An OpenAI-compatible server over an exported directory OUT (or --demo):
    /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize."""
    _need_serve_extra()
    if (out is None) == (not demo):
        raise DFlashError("give an exported directory OUT or --demo (not both)")
    # as given, checked (before --demo's first export); the directory, batch and slots are resolved below
    options = ServeOptions(out, **fields)
    options.api_key = _api_key(options.api_key, api_key_file)
    options.speculation = resolve_speculation(options.no_draft, options.speculation)
    if (options.slots or 1) > 1 and options.backend != "ort":
        raise DFlashError(f"--slots {options.slots} needs --backend ort (its slots share one copy of the weights)")
    if ray.use_ray and not installed("ray.serve"):
        raise DFlashError('--ray needs Ray Serve: pip install "dflash-export[ray]"')
    deploy = ray.deploy()
    options.chat_template = _template(options.chat_template)
    directory = demo_artifact() if demo else out
    if ray.use_ray:
        directory = Path(directory).resolve()  # every replica opens this path on its own node
    # a wrong folder, --threads or runtime.json is one line now, not after binding
    manifest = M.load_manifest(directory, verify=False)
    M.check_readable(directory, manifest)
    settings = settings_for(directory, options)
    options.directory = Path(directory)
    options.model_name = options.model_name or ("dflash-demo" if demo else None)
    options.max_batch, options.slots = _batch_rows(directory, manifest, options.max_batch, options.slots,
                                                   options.backend, options.provider, options.speculative)
    if not _is_loopback(host) and not options.api_key:
        click.echo(f"warning: listening on {host} without an API key: anyone who can reach it can use it "
                   "(set --api-key or DFLASH_API_KEY)", err=True)
    if ray.use_ray:
        return serve_ray.run(options, host=host, port=port, address=ray.ray_address, proxy=ray.proxy,
                             shutdown_timeout=shutdown_timeout, **deploy)
    options.settings = settings  # this process loads the engine: resolved once, here
    _serve_here(options, host, port, shutdown_timeout)


def _serve_here(options: ServeOptions, host: str, port: int, shutdown_timeout: float) -> None:
    """One process: bind, load in the background (/health 503 until ready), print the URL, serve
    until Ctrl-C / SIGTERM, then drain for up to shutdown_timeout seconds."""
    sock = _bind(host, port)
    port = sock.getsockname()[1]
    app = serve_app.create_app(options)
    holder = app.state.holder

    def cancel_in_flight():  # the bound: streams then end with an error event, waiting requests get a 503
        if holder.engine is not None:
            holder.engine.cancel_all()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # no re-raise of the signal after shutdown: exit 0
            if self.should_exit:  # a second Ctrl-C: now
                self.force_exit = True
                cancel_in_flight()
            else:
                holder.draining = True
                timer = threading.Timer(shutdown_timeout, cancel_in_flight)
                timer.daemon = True  # exiting earlier must not wait for it
                timer.start()
            self.should_exit = True

    # uvicorn's own bound (it cuts connections mid-response) only backs ours up
    server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout + 5,
                                   lifespan="on", access_log=False))
    failed: list[str] = []

    def announce():
        holder.ready.wait()
        if holder.error is not None:
            failed.append(holder.error)
            server.should_exit = True
            return
        e = holder.engine
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        mode = f"speculative (DFlash, speculation {options.speculation})" if e.has_drafter else "plain decoding"
        rows = f"batch {options.max_batch}" if options.max_batch > 1 else f"{options.slots} slot(s)"
        click.echo(f"dflash-export serve: ready at {url}  model {e.model!r}, {rows}, "
                   f"queue {options.max_queue}, {mode}, {e.slots[0].backend.provider}, context {e.max_len}")
        auth = ' -H "Authorization: Bearer $DFLASH_API_KEY"' if options.api_key else ""
        click.echo(f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
                   f"-d '{{\"model\": \"{e.model}\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32, \"temperature\": 0}}'")
        sys.stdout.flush()

    threading.Thread(target=announce, name="dflash-announce", daemon=True).start()
    click.echo(f"dflash-export serve: listening on {host}:{port}, loading {options.directory} ...", err=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failed:
        raise DFlashError(failed[0])
    click.echo("dflash-export serve: stopped", err=True)


COMMANDS = [serve]
