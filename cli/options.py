"""Options several commands share, declared once: the models (--target, --draft and their
revisions), sampling, prompts; and the options generated from a record's fields (runtime/options.py):
the run's (RunOptions: backend, provider, threads, spin, verify, speculation), `serve`'s and `train-draft`'s."""

from __future__ import annotations

import dataclasses
import functools

import click

from ..runtime.errors import DFlashError
from ..runtime.sampling import Sampling
from ..runtime.settings import RunOptions


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


def resolve_speculation(no_draft: bool, speculation: str) -> str:
    """--no-draft is --speculation never: the mode both give, or the one-line error when they disagree."""
    if no_draft and speculation == "always":
        raise DFlashError("--no-draft means --speculation never; leave out one of them")
    return "never" if no_draft else speculation


def run_options(*names: str):
    """The run's options (runtime/settings.py RunOptions: --backend --provider --threads --spin/--no-spin
    --verify --speculation; `names`: only these); the command receives them as one record, `run`."""
    return field_options(RunOptions, into="run", only=names or None)


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


class RenamedOption(click.Option):
    """An option that still takes its old names (`old`: renamed, kept working) without showing them in --help."""

    def __init__(self, decls, old: tuple[str, ...] = (), **kw):
        super().__init__([*decls[:-1], *old, decls[-1]], **kw)
        self.old = set(old)

    def get_help_record(self, ctx):
        shown = self.opts
        self.opts = [o for o in shown if o not in self.old]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shown


def field_options(cls, into: str | None = None, only: tuple[str, ...] | None = None):
    """One click option per field of dataclass `cls` made with runtime/options.py `option` (`only`: these
    fields alone), in field order: named `--field-name` (or the metadata's `opt`), the field's default
    unless the metadata gives the command's own, help, type and choices from the metadata (`old`: former
    names that still work, hidden from --help). The command receives them as keywords named after the fields, or with `into` as one `cls` record of that name."""
    fields = [fld for fld in dataclasses.fields(cls) if fld.metadata.get("option") and (only is None or fld.name in only)]
    own = cls.__dict__.get("__annotations__", {})
    fields.sort(key=lambda fld: fld.name not in own)  # the record's own first, then those it inherits (--help's order)

    def decorate(command):
        f = command
        if into:
            @functools.wraps(command)
            def f(*args, **kwargs):
                return command(*args, **{into: cls(**{fld.name: kwargs.pop(fld.name) for fld in fields})}, **kwargs)
        for fld in reversed(fields):
            kw = dict(fld.metadata["option"])
            name = kw.pop("opt", "--" + fld.name.replace("_", "-"))
            if "choices" in kw:
                kw["type"] = click.Choice(kw.pop("choices"))
            if not kw.get("required") and not kw.get("multiple"):
                kw.setdefault("default", fld.default)
            if "old" in kw:
                kw["cls"] = RenamedOption
            f = click.option(name, fld.name, **kw)(f)
        return f

    return decorate
