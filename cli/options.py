"""Options several commands share, declared once: the models (--target, --draft and their
revisions), the device (backend, provider, threads, spin, verify), sampling, prompts; and the
options generated from a dataclass's fields (`train-draft`, `serve`)."""

from __future__ import annotations

import dataclasses
import functools

import click

from ..runtime.errors import DFlashError
from ..runtime.sampling import Sampling


def model_options(required: bool, target_help: str = "", draft_help: str = ""):
    """--target / --draft (a directory or a Hugging Face id, `org/name[@revision]`; export/sources.py)
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


def field_options(cls, into: str | None = None):
    """One click option per field of dataclass `cls` that carries an option's metadata, in field order
    (train/config.py TrainConfig, serve/options.py): named `--field-name` (or the metadata's `opt`), the
    field's default unless the metadata gives the command's own, help, type and choices from the metadata.
    The command receives them as keywords named after the fields, or with `into` as one `cls` record of that name."""
    fields = [fld for fld in dataclasses.fields(cls) if fld.metadata.get("option")]

    def decorate(command):
        f = command
        if into:
            @functools.wraps(command)
            def f(*args, **kwargs):
                return command(*args, **{into: cls(**{fld.name: kwargs.pop(fld.name) for fld in fields})}, **kwargs)
        for fld in reversed(fields):
            kw = dict(fld.metadata["option"])
            name = kw.pop("opt", "--" + fld.name.replace("_", "-"))
            if not kw.get("required") and not kw.get("multiple"):
                kw.setdefault("default", fld.default)
            f = click.option(name, fld.name, **kw)(f)
        return f

    return decorate
