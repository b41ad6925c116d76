"""An activation cache is bound to what its run's log records about it, so another's is never read.

A cache sits under a name (rewind.stores.cachenames) that says which trunk, steps and config it holds,
but a name is easily given: another run's cache, copied in under it, would be read as this run's. So
a cache's spec (rewind.stores.cachefiles.CacheSpec) carries `cache_identity`: a digest of its
ActivationsCached record's fields known before it is written (trunk version, first step, steps, rows,
path) and of what the state on record says the trunk's inputs are (the config's hash, every dataset's
identity, the tokenizer's, the pretrained weights', the parent run). Caches of computations that differ
in any of these differ in identity. A reader (rewind.engine.model.trunkreader, before it reads a chunk) and
`rewind verify` ask `identity_problem`: a cache that is another's is not read, the trunk is recomputed
(the same bits, slower) and verify names it; a writer finding another's at its path starts it over
(a spec that differs: ActivationCache.create).

What the identity cannot tell apart is two runs of the same config on the same data, whose caches hold
the same values (up to the thread count and device each computed with). And it is a claim the cache
makes, not a hash of its chunks (the log records none; that would take a field of ActivationsCached),
so a cache edited to claim this run's identity is not caught. A cache written before caches carried an
identity (OLDER_RELEASE) is not read either: recomputed, the same bits; verify notes it.
"""

from __future__ import annotations

import hashlib

import msgspec

from rewind.states.state import State
from rewind.stores.cachefiles import CacheSpec

OLDER_RELEASE = "written before caches carried the identity of what made them"


def cache_identity(state: State, version: int, step: int, num_steps: int, num_rows: int, path: str) -> str:
    """The identity of the cache of trunk `version` for the steps [step, step + num_steps) at `path`
    (its ActivationsCached's fields) in a run whose state is `state`. The same for the writer, before
    the record, and for every reader after it: nothing it reads from the state changes while the state
    holds the cache (a ConfigChanged drops it)."""
    made_of = [version, step, num_steps, num_rows, path, state.config_hash, state.data, state.tokenizer,
               state.pretrained, state.parent_run]  # fmt: skip
    return hashlib.sha256(msgspec.msgpack.encode(made_of, order="deterministic")).hexdigest()


def identity_problem(spec: CacheSpec, state: State) -> str:
    """Why the cache of `spec` is not the one `state.activation_cache` records ("" if it is): another
    computation's, or OLDER_RELEASE (an upgrade's, not damage)."""
    record = state.activation_cache
    if record is None:
        return "no cache on record"
    expected = cache_identity(state, record.version, record.step, record.num_steps, record.num_rows, record.path)
    if spec.identity == expected:
        return ""
    if not spec.identity:
        return OLDER_RELEASE
    return "not this run's: made by another run, config or data (its identity is not the one the log gives it)"
