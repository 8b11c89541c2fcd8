"""Options declared once, as fields of a record: a field made with `option` is also a command-line
option of every command that takes the record (cli/options.py `field_options` generates it),
named `--field-name` (or the metadata's `opt`), with the field's default, help and type. The
records live beside what reads them (runtime/settings.py `RunOptions`, serve/options.py,
train/config.py); click itself stays in the CLI.
"""

from __future__ import annotations

from dataclasses import field


def option(value=None, help: str | None = None, **click_kw):  # noqa: A002: click's own word
    """A field (default `value`) that is also a command-line option. click_kw as click.option takes them,
    and: `opt` the option's name, `choices` a tuple of the values it takes, `default` the command's own
    where it is not the record's, `old` a tuple of former names that still work (hidden from --help)."""
    return field(default=value, metadata={"option": dict(help=help, **click_kw)})
