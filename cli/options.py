"""Options several commands share, declared once: the models (--target, --draft and their
revisions), the device (backend, provider, threads, spin, verify), sampling, prompts, and the
Ray flags of `serve --ray`."""

from __future__ import annotations

import functools

import click

from ..errors import DFlashError
from ..runtime.sampling import Sampling


def model_options(required: bool, target_help: str = "", draft_help: str = ""):
    """--target / --draft (a directory or a Hugging Face id, `org/name[@revision]`; sources.py)
    and --revision / --draft-revision; the command receives target_dir, draft_dir, revision, draft_revision."""
    where = ("A local directory (which always wins) or a Hugging Face id, org/name[@revision], fetched into the "
             "Hugging Face cache (HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply).")
    options = (
        click.option("--target", "target_dir", required=required, metavar="DIR|ID",
                     help=f"Target checkpoint (config.json + *.safetensors [+ tokenizer]){target_help}. {where}"),
        click.option("--revision", help="The target's revision on the Hub: branch, tag or commit [default: main]."),
        click.option("--draft", "draft_dir", required=required, metavar="DIR|ID",
                     help=f"DFlash drafter (z-lab or speculators format){draft_help}. {where}"),
        click.option("--draft-revision", help="The drafter's revision on the Hub: branch, tag or commit [default: main]."),
    )

    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


provider_option = click.option(
    "--provider", default="cpu", show_default=True, help="ONNX Runtime execution provider: cpu | cuda | tensorrt."
)
threads_option = click.option(
    "--threads", type=int, default=None,
    help="ONNX Runtime intra-op threads of every graph (default: runtime.json's calibrated count, else 1 for "
         "small models and one per CPU from hidden size 1024).")
spin_option = click.option(
    "--spin/--no-spin", default=None,
    help="Let ORT's idle threads spin [default: as `bench --calibrate` measured (it tries both), else off: "
         "spinning made calls ~2x slower on shared vCPUs].")
verify_option = click.option(
    "--verify", type=click.Choice(["auto", "full"]), default="auto", show_default=True,
    help="auto: verify the drafter's confident prefix as runtime.json's calibrated policy says (the full block "
         "when there is none); full: always the whole block.")
speculation_option = click.option(
    "--speculation", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
    help="auto: draft while it pays (recent acceptance against runtime.json's calibrated costs), else plain steps "
         "that probe now and then; always: draft every round; never: plain decoding of the target.")


def resolve_speculation(no_draft: bool, speculation: str) -> str:
    """--no-draft is --speculation never: the mode both give, or the one-line error when they disagree."""
    if no_draft and speculation == "always":
        raise DFlashError("--no-draft means --speculation never; leave out one of them")
    return "never" if no_draft else speculation


backend_option = click.option(
    "--backend", type=click.Choice(["ort", "trt"]), default="ort", show_default=True,
    help="ort: ONNX Runtime (see --provider); trt: the TensorRT engines of `dflash-export build`.",
)


def device_options(f):
    """--provider --backend --threads --spin/--no-spin --verify."""
    for option in (verify_option, spin_option, threads_option, backend_option, provider_option):
        f = option(f)
    return f


def sampling_options(f):
    """--temperature --top-k --top-p --seed: the command receives them as one record, `sampling`
    (runtime/sampling.py Sampling, which checks them: one line each)."""

    @functools.wraps(f)
    def wrapper(*args, temperature, top_k, top_p, seed, **kwargs):
        return f(*args, sampling=Sampling(temperature, top_k, top_p, seed), **kwargs)

    for option in (
        click.option("--seed", default=0, show_default=True, type=int, help="Seeds the sampling stream (deterministic)."),
        click.option("--top-p", default=1.0, show_default=True, type=float, help="1 disables."),
        click.option("--top-k", default=0, show_default=True, type=int, help="0 disables."),
        click.option("--temperature", default=0.0, show_default=True, type=float,
                     help="0 = greedy (so is anything below 1e-5)."),
    ):
        wrapper = option(wrapper)
    return wrapper


def num_prompts_option(default: int, help: str):
    """--num-prompts N, and the deprecated spelling of it, --prompts N (kept for one release).

    `--prompts` is a file of prompts everywhere else; here an integer still counts, with a
    warning, and a path is handed on as `prompts_file` (the command says what it does with it)."""

    def deprecated(ctx, param, value):
        if value is None:
            return None
        try:
            n = int(value)
        except ValueError:
            return value  # a file
        click.echo(f"warning: --prompts {n} is deprecated (it will be a file of prompts, as in bench): "
                   f"use --num-prompts {n}", err=True)
        ctx.meta["deprecated_num_prompts"] = n
        return None

    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, num_prompts, prompts_file, **kwargs):
            n = click.get_current_context().meta.get("deprecated_num_prompts")
            return f(*args, num_prompts=num_prompts if n is None else n, prompts_file=prompts_file, **kwargs)

        wrapper = click.option("--prompts", "prompts_file", callback=deprecated, metavar="FILE",
                               help="A file of prompts, one per line (or *.jsonl with a \"prompt\" field); "
                                    "an integer N still works as --num-prompts N (the old spelling).")(wrapper)
        return click.option("--num-prompts", default=default, show_default=True, type=int, help=help)(wrapper)

    return decorate


RAY_FLAGS = (
    click.option("--ray", "use_ray", is_flag=True,
                 help="Run as a Ray Serve application (replicas across nodes; needs the ray extra). See docs/ray.md."),
    click.option("--replicas", type=int, help="--ray: a fixed number of replicas [default: 1]."),
    click.option("--autoscale", metavar="MIN:MAX", help="--ray: autoscale between MIN and MAX replicas on ongoing requests."),
    click.option("--ray-address", help="--ray: an existing cluster (e.g. 10.0.0.5:6379) [default: a local head on 127.0.0.1]."),
    click.option("--replica-cpus", type=float, default=1.0, show_default=True, help="--ray: CPUs reserved per replica."),
    click.option("--replica-gpus", type=float, default=0.0, show_default=True,
                 help="--ray: GPUs per replica (1 with --provider cuda: one GPU each)."),
    click.option("--max-replicas-per-node", type=int, help="--ray: at most this many replicas on one node (1: spread)."),
    click.option("--max-ongoing", type=int, help="--ray: requests Ray sends a replica at once [default: batch rows (or slots) + queue + 8]."),
    click.option("--upscale-delay", type=float, default=30.0, show_default=True,
                 help="--autoscale: seconds of load before adding a replica."),
    click.option("--downscale-delay", type=float, default=600.0, show_default=True,
                 help="--autoscale: seconds of low load before removing one."),
    click.option("--health-check-period", type=float, default=10.0, show_default=True,
                 help="--ray: seconds between replica health checks (slot threads alive, artifact files unchanged)."),
    click.option("--proxy", type=click.Choice(["HeadOnly", "EveryNode"]), default="HeadOnly", show_default=True,
                 help="--ray: Ray Serve HTTP proxies on the head only, or on every node (same --host/--port each)."),
)
RAY_NAMES = ("use_ray", "replicas", "autoscale", "ray_address", "replica_cpus", "replica_gpus", "max_replicas_per_node",
             "max_ongoing", "upscale_delay", "downscale_delay", "health_check_period", "proxy")


def ray_options(f):
    """The --ray flags as one group: the command receives them as one dict, `ray`."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, ray={k: kwargs.pop(k) for k in RAY_NAMES}, **kwargs)

    for option in reversed(RAY_FLAGS):
        wrapper = option(wrapper)
    return wrapper
