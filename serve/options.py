"""How a server was started, defined once: `ServeOptions`, the record the command line
(cli/serve.py), a Ray replica (serve/ray.py) and the app pass whole to what loads and serves
the model, and `RayOptions`, the replicas of `serve --ray`.

A field with an option's metadata is also an option of `dflash-export serve`: cli/serve.py
generates the command from these fields (`--name-with-dashes`, help, type and default here),
so an option is added, renamed or given a new default here and nowhere else. `ServeOptions`
is a `RunOptions` (runtime/settings.py: backend, provider, threads, spin, verify, speculation,
the options every running command shares), passed whole to `open_artifact`; a field without
metadata is set from code only. Bounds are checked once, when the record is made.
click-only: no torch, no ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from ..runtime.errors import DFlashError
from ..runtime.options import option
from ..runtime.settings import RunOptions, Settings
from .formats import FORMATS


@dataclass
class ServeOptions(RunOptions):
    directory: Path
    max_batch: int = option(1, "Requests generating at once as rows of one batched loop: they join at a round boundary "
                               "and leave when done [default: 4 where the export and memory allow, else 1].",
                            type=int, default=None)  # > 1: one batched loop of this many rows (serve/batch.py)
    slots: int = option(1, "Instead of --max-batch: this many separate loops over shared weights, each reusing its "
                           "last prompt's prefix (the older mode; docs/serve.md compares them).", type=int, default=None)
    max_queue: int = option(16, "Requests that may wait for a row or slot (FIFO); more get 429.", type=int,
                            show_default=True)
    api_key: str | None = option(None, "Require 'Authorization: Bearer KEY' (env: DFLASH_API_KEY).",
                                 envvar="DFLASH_API_KEY")
    model_name: str | None = option(None, "The model id clients send [default: the directory's name].")
    default_max_tokens: int = option(256, "max_tokens when a request omits it (capped by the room left in the context).",
                                     opt="--max-tokens", type=int, show_default=True)
    chat_template: str | None = option(None, "Jinja chat template file (overrides the artifact's).",
                                       type=click.Path(path_type=Path))  # the record holds the file's text
    tool_format: str = option("auto", "How the model writes reasoning and tool calls [default: from its chat template "
                                      "and architecture].", type=click.Choice(FORMATS), show_default=False)
    no_draft: bool = option(False, "Load without the drafter: plain decoding only (= --speculation never).",
                            is_flag=True)  # the flag messages name
    access_log: bool = option(False, "No line per request on stderr.", opt="--no-access-log", is_flag=True,
                              flag_value=False, default=True)  # one line per request on stderr (the command's default)
    max_body_bytes: int = 4 << 20
    settings: Settings | None = None  # resolved by the command already (one process); None: load_engine resolves

    def __post_init__(self):
        super().__post_init__()
        for name, value, low in (("--max-batch", self.max_batch, 1), ("--slots", self.slots, 1),
                                 ("--max-queue", self.max_queue, 0), ("--max-tokens", self.default_max_tokens, 1)):
            if value is not None and value < low:
                raise DFlashError(f"{name} must be >= {low} (got {value})")

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


@dataclass
class RayOptions:
    """`serve --ray`: where and how many replicas run; `deploy()` turns them into serve/ray.py build's keywords."""

    use_ray: bool = option(False, "Run as a Ray Serve application (replicas across nodes; needs the ray extra). "
                                  "See docs/ray.md.", opt="--ray", is_flag=True)
    replicas: int | None = option(None, "--ray: a fixed number of replicas [default: 1].", type=int)
    autoscale: str | None = option(None, "--ray: autoscale between MIN and MAX replicas on ongoing requests.",
                                   metavar="MIN:MAX")
    ray_address: str | None = option(None, "--ray: an existing cluster (e.g. 10.0.0.5:6379) [default: a local head "
                                           "on 127.0.0.1].")
    replica_cpus: float = option(1.0, "--ray: CPUs reserved per replica.", type=float, show_default=True)
    replica_gpus: float = option(0.0, "--ray: GPUs per replica (1 with --provider cuda: one GPU each).", type=float,
                                 show_default=True)
    max_replicas_per_node: int | None = option(None, "--ray: at most this many replicas on one node (1: spread).",
                                               type=int)
    max_ongoing: int | None = option(None, "--ray: requests Ray sends a replica at once [default: batch rows (or "
                                           "slots) + queue + 8].", type=int)
    upscale_delay: float = option(30.0, "--autoscale: seconds of load before adding a replica.", type=float,
                                  show_default=True)
    downscale_delay: float = option(600.0, "--autoscale: seconds of low load before removing one.", type=float,
                                    show_default=True)
    health_check_period: float = option(10.0, "--ray: seconds between replica health checks (slot threads alive, "
                                               "artifact files unchanged).", type=float, show_default=True)
    proxy: str = option("HeadOnly", "--ray: Ray Serve HTTP proxies on the head only, or on every node (same "
                                    "--host/--port each).", type=click.Choice(["HeadOnly", "EveryNode"]),
                        show_default=True)

    def deploy(self) -> dict:
        """serve/ray.py build's keywords, every flag checked (one line each); {} without --ray."""
        given = [f for f, v in (("--replicas", self.replicas), ("--autoscale", self.autoscale),
                                ("--ray-address", self.ray_address), ("--max-replicas-per-node", self.max_replicas_per_node),
                                ("--max-ongoing", self.max_ongoing)) if v is not None]
        if not self.use_ray:
            if given:
                raise DFlashError(f"{given[0]} needs --ray")
            return {}
        if self.replicas is not None and self.autoscale is not None:
            raise DFlashError("give --replicas N or --autoscale MIN:MAX, not both")
        kw = dict(num_cpus=self.replica_cpus, num_gpus=self.replica_gpus, max_ongoing=self.max_ongoing,
                  max_replicas_per_node=self.max_replicas_per_node, upscale_delay=self.upscale_delay,
                  downscale_delay=self.downscale_delay, health_period=self.health_check_period)
        if self.autoscale is not None:
            lo, sep, hi = self.autoscale.partition(":")
            if not (sep and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
                raise DFlashError(f"--autoscale takes MIN:MAX with 1 <= MIN <= MAX, e.g. 1:4 (got {self.autoscale!r})")
            kw["autoscale"] = (int(lo), int(hi))
        else:
            kw["replicas"] = 1 if self.replicas is None else self.replicas
            if kw["replicas"] < 1:
                raise DFlashError(f"--replicas must be >= 1 (got {self.replicas})")
        for name, v in (("--replica-cpus", self.replica_cpus), ("--replica-gpus", self.replica_gpus),
                        ("--upscale-delay", self.upscale_delay), ("--downscale-delay", self.downscale_delay),
                        ("--health-check-period", self.health_check_period)):
            if v < 0:
                raise DFlashError(f"{name} must be >= 0 (got {v})")
        if self.max_replicas_per_node is not None and self.max_replicas_per_node < 1:
            raise DFlashError(f"--max-replicas-per-node must be >= 1 (got {self.max_replicas_per_node})")
        return kw
