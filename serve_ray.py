"""Deprecated import path, kept for one release: Ray configs now name `dflash_export.serve.ray`.

`deploy/ray-serve.yaml` and `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` written for earlier
releases say `dflash_export.serve_ray:app_builder` / `:proxy_middlewares`; they keep working.
"""

import warnings

from .serve.ray import app_builder, proxy_middlewares  # noqa: F401

warnings.warn("dflash_export.serve_ray is deprecated: use dflash_export.serve.ray", DeprecationWarning,
              stacklevel=2)
