"""Reading the frozen trunk's cached outputs (written by rewind.engine.run.trunkcache): a step gets its rows
from the cache the state names, or None, and then computes the trunk, to the same bits.

A cache is read only if it is the one the log records (rewind.stores.cachebinding.identity_problem, the
check `rewind verify` makes): another run's copied in under the right name is not, and the run says so
once (ForeignCache) and recomputes the trunk; one written before caches carried an identity is
recomputed without a word (an upgrade's, verify notes it)."""

from __future__ import annotations

import warnings

import torch

from rewind.states.events import ActivationsCached
from rewind.states.state import State
from rewind.stores.activations import ActivationCache, CacheError
from rewind.stores.cachebinding import OLDER_RELEASE, identity_problem
from rewind.stores.confine import NotConfined, inside_path
from rewind.stores.fsio import filesystem


def cache_url(run_dir: str, path: str) -> str:
    """The URL of the cache at `path` (a name the record checks passed) in the run. Locally, the cache
    and `cache/` must stay inside the run once links are resolved: NotConfined otherwise."""
    location = filesystem(run_dir)
    if location.is_local:
        inside_path(location.path, path.split("/"))
    return location.join(*path.split("/")).url


class ForeignCache(UserWarning):
    """The activation cache at the record's path is not the one the log records: never read."""

    def __init__(self, run_dir: str, path: str, problem: str):
        super().__init__(
            f"{run_dir}: activation cache {path}: {problem}; not read: the trunk is recomputed (the same "
            f"bits, slower); delete it (`rewind verify {run_dir}` names it)"
        )


class TrunkReader:
    """Opens the state's cache once per process and hands each step its rows."""

    def __init__(self) -> None:
        self._opened: tuple[ActivationsCached, ActivationCache] | None = None
        self._refused: ActivationsCached | None = None  # the record whose cache is not the log's

    def rows(self, run_dir: str, state: State, step: int) -> torch.Tensor | None:
        """The cached trunk outputs of step `step` (batch, seq, width), or None when the state has no
        cache covering it (training then runs the trunk)."""
        ref = state.activation_cache
        if ref is None or not ref.path or not ref.step <= step < ref.step + ref.num_steps or ref == self._refused:
            return None
        if self._opened is None or self._opened[0] != ref:
            try:
                opened = ActivationCache.open(cache_url(run_dir, ref.path))
                if opened.spec.num_rows != ref.num_rows or not opened.is_complete():
                    return None  # not the cache the record names: recomputed instead, to the same bits
                if problem := identity_problem(opened.spec, state):
                    self._refused = ref
                    if problem != OLDER_RELEASE:
                        warnings.warn(ForeignCache(run_dir, ref.path, problem), stacklevel=2)
                    return None
                self._opened = (ref, opened)
            except (CacheError, NotConfined):
                # Gone, damaged (a copied run directory without cache/) or leading out of the run: the
                # trunk is recomputed, which gives the same bits, only slower.
                return None
        cache = self._opened[1]
        start, stop = cache.chunk_rows(step - ref.step)
        try:
            return cache.read_rows(start, stop)
        except CacheError:
            return None  # damaged since it was completed: recomputed instead, to the same bits
