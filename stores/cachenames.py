"""Where a run keeps its activation caches (rewind.stores.activations). Which names a record may give
one is decided where records are admitted (rewind.states.admission.cache_path_problem)."""

from __future__ import annotations

from rewind.states.admission import CACHE_DIR


def cache_path(version: int, first_step: int, config_digest: str) -> str:
    """The cache of trunk `version` for the steps from `first_step` under the config whose hash is
    `config_digest`, relative to the run directory (rewind.engine.run.trunkcache says why all three)."""
    return f"{CACHE_DIR}/trunk-{version}-{first_step:08d}-{config_digest[:12]}.zarr"
