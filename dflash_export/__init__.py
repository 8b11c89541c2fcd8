"""Where `import dflash_export` lands in a checkout that is not installed.

The package is the repository's top level: its sub-packages are the pipeline's folders
(`models/`, `export/`, `runtime/`, `cli/`, `serve/`, `train/`, `demo/`) and its init is the
top-level `__init__.py`; pyproject.toml maps `dflash_export` onto that folder when it is
installed, and every relative import resolves by path from the file that makes it. This file
only points the package's path at the top level, so `python -c "import dflash_export.cli"`
works from a checkout too.
"""

from pathlib import Path

_TOP = Path(__file__).resolve().parent.parent
__path__ = [str(_TOP)]  # noqa: F821 - a package's search path, read by the import system
exec(compile((_TOP / "__init__.py").read_text(), str(_TOP / "__init__.py"), "exec"))
