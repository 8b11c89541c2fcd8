"""The `dflash-export` command line: one subcommand per pipeline step.

Each command lives in its own module of this folder (export.py, run.py, serve.py, ...) and reads
heavy libraries (torch, onnx, tensorrt) through lazy_import, so `generate` and `bench` run where
torch is not installed.
"""

from __future__ import annotations

import traceback

import click

from .. import __version__
from ..runtime.errors import DFlashError, InternalError
from . import demo, export, info, run, serve, train, trt


class Group(click.Group):
    """Turns every DFlashError, and click's usage errors (a bad choice, a missing option, an
    unknown command), into one line on stderr and exit status 2: never a traceback, never
    click's three-line usage block. An InternalError is a bug: its line asks for a report and
    the traceback follows (exit 3)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            where = (e.ctx or ctx).command_path
            click.echo(f"error: {e.format_message().rstrip('.')}; see `{where} --help`", err=True)
            ctx.exit(2)
        except DFlashError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)
        except InternalError as e:
            click.echo(f"internal error (please report): {e}\n{traceback.format_exc().rstrip()}", err=True)
            ctx.exit(3)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            ctx.exit(130)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dflash-export")
def cli() -> None:
    """Export DFlash speculative decoding (a target LLM + its block-diffusion drafter) to
    ONNX Runtime and TensorRT, check parity against PyTorch, and run it.

    \b
    Pipeline:
      dflash-export export --target T --draft D --out OUT   trace to ONNX + manifest
      dflash-export check OUT --target T --draft D          parity vs PyTorch
      dflash-export info OUT                                what OUT is: graphs, I/O, sizes, hashes
      dflash-export generate OUT --prompt "..."             speculative decoding (ORT)
      dflash-export bench OUT                               speedup vs plain decoding
      dflash-export build OUT                               TensorRT engines (needs an NVIDIA GPU)
      dflash-export serve OUT                               OpenAI-compatible server
    Try it: dflash-export demo (the shipped pair, end to end, offline).
    """


for _module in (export, info, run, trt, train, demo, serve):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def main() -> None:
    cli()
