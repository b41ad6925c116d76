"""Where a run keeps its activation caches (rewind.stores.activations), and which names a record may give one.

An ActivationsCached record names its cache by a path relative to the run directory, and a log is
untrusted input (a CRC is not a signature): a forged path could lead a resume to train on another run's
cache, which is as consistent as its own. So a record's path must be a name rewind writes, of the
record's own trunk version and first step:

    cache/trunk-<version>-<first step:08d>-<config hash, 12 hex digits>.zarr   runs of this release
    cache/trunk-<version>.zarr                                                 the first runs with growth

and "" (a dry-run's record: no cache). Where the name leads once links are resolved is checked where
the cache is opened (rewind.engine.trunkcache). No torch, no zarr: every reader of a log checks this.
"""

from __future__ import annotations

import re

CACHE_DIR = "cache"
_PATH = re.compile(r"cache/trunk-(\d{1,9})(?:-(\d{8,12})-[0-9a-f]{12})?\.zarr", re.ASCII)


def cache_path(version: int, first_step: int, config_digest: str) -> str:
    """The cache of trunk `version` for the steps from `first_step` under the config whose hash is
    `config_digest`, relative to the run directory (rewind.engine.trunkcache says why all three)."""
    return f"{CACHE_DIR}/trunk-{version}-{first_step:08d}-{config_digest[:12]}.zarr"


def cache_path_problem(path: object, version: int, step: int) -> str:
    """Why `path` cannot be the cache an ActivationsCached(version, step) names ("" if it can)."""
    if path == "":
        return ""
    match = _PATH.fullmatch(path) if isinstance(path, str) else None
    if match is None:
        return (
            f"activation cache path {str(path)[:80]!r} is not one rewind writes "
            f"({CACHE_DIR}/trunk-<version>-<step>-<config>.zarr, inside the run)"
        )
    if int(match.group(1)) != version or (match.group(2) is not None and int(match.group(2)) != step):
        return f"activation cache path {path} is not the cache of its record's trunk {version} at step {step}"
    return ""
