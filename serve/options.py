"""How a server was started: one record, `ServeOptions`, that the command line (cli/serve.py),
a Ray replica (serve/ray.py) and the app pass whole to what loads and serves the model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServeOptions:
    directory: Path
    model_name: str | None = None  # default: the directory's name
    slots: int = 1
    max_batch: int = 1  # > 1: one batched loop of this many rows (serve/batch.py) instead of slots
    max_queue: int = 16
    api_key: str | None = None
    backend: str = "ort"
    provider: str = "cpu"
    threads: int | None = None  # None: runtime.json's calibrated count, else the default (runtime/settings.py)
    spin: bool | None = None
    verify: str = "auto"
    default_max_tokens: int = 256
    max_body_bytes: int = 4 << 20
    chat_template: str | None = None  # template text overriding the artifact's
    speculation: str = "auto"  # auto: the controller decides per round; always: draft every round; never: plain
    no_draft: bool = False  # started with --no-draft (= speculation never; the flag messages name)
    access_log: bool = False  # one line per request on stderr (the command turns it on; --no-access-log)

    @property
    def speculative(self) -> bool:
        """Whether the drafter is loaded (otherwise every request decodes plainly)."""
        return self.speculation != "never" and not self.no_draft

    @property
    def plain_flag(self) -> str:
        """The flag that made this server plain, as the operator gave it."""
        return "--no-draft" if self.no_draft else "--speculation never"

    @property
    def rows(self) -> int:
        """Requests generating at once: batch rows, or slots."""
        return max(self.max_batch, self.slots)

    @property
    def model(self) -> str:
        return self.model_name or Path(self.directory).resolve().name
