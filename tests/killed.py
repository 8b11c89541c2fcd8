"""Kill -9 a `dflash-export` run at a chosen point: what a killed run leaves, for the next run to clean.

The child runs the command with one function wrapped: once the chosen call returns, it prints
`held` and sleeps; the test kills it there (SIGKILL: no except, finally or atexit of the
command runs) and gets its pid, the suffix of what it left beside its output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HOLD = """
import importlib, sys, time
sys.path.insert(0, {tests!r})
{setup}
owner = importlib.import_module({module!r})
for part in {path!r}[:-1]:
    owner = getattr(owner, part)
real, calls = getattr(owner, {path!r}[-1]), []
def held(*a, **k):
    r = real(*a, **k)
    calls.append(1)
    if len(calls) == {calls}:
        print("held", flush=True)
        time.sleep(600)
    return r
setattr(owner, {path!r}[-1], held)
from dflash_export.cli import cli
cli({args!r})
"""


def kill_after(module: str, name: str, args: list[str], setup: str = "", calls: int = 1) -> int:
    """Run `dflash-export ARGS` in a child, kill it -9 right after its `calls`-th call of
    `module.name` (a dotted name inside the module: "Class.method") returns; `setup`: code the
    child runs first. -> the child's pid."""
    code = HOLD.format(tests=str(Path(__file__).parent), setup=setup, module=module, path=name.split("."), args=args,
                       calls=calls)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in p.stdout:
            if line.strip() == "held":
                break
            seen.append(line)
        else:
            raise AssertionError(f"the child ended before {module}.{name} returned:\n{''.join(seen)}")
    finally:
        p.kill()
        p.wait()
    return p.pid
