"""The frozen trunk's outputs, computed once per trunk and read by training instead of the trunk.

When a stack is appended on a trunk that no longer trains (rewind.states.growth.caches_trunk), the
residual stream entering the new stack is a pure function of each step's rows. `write_cache` computes
it for every step up to the next growth, exactly as the training step would (the same rows from the
data cursors, the same micro-batches, the same dropout seeds), and stores one chunk per step in a
zarr array laid out in reading order (`rewind.stores.activations`), so a step reads one contiguous
chunk. The ActivationsCached record that follows says the cache is complete; a writer killed half way
leaves chunks without completion records, and the next process writes only those.

`rewind.engine.model.trunkreader` gives a step its cached rows. Values read are bitwise the values a recomputation gives,
so a run with the cache and one without end with the same weights.

A cache is bound to the run that made it (its spec carries the identity the log gives it: see
rewind.stores.activations): another's, copied in under the right name, is never read (the trunk is
recomputed, to the same bits, with one warning) and `rewind verify` names it.

A cache is read and written only inside the run: the record's path is a name rewind writes (checked
when the log is read: rewind.stores.cachenames), and in a local run directory `cache/` and the cache
must not lead out of it through a link. A cache that does is never read (the trunk is recomputed, to
the same bits) nor written through (NotConfined: one line, exit 1); `rewind verify` names it.
"""

from __future__ import annotations

import torch

from rewind.engine.data.example_batches import step_rows
from rewind.engine.model.placement import in_sharded_run, model_device
from rewind.engine.model.ranks import is_writer, shared_event
from rewind.engine.model.trunkreader import cache_url
from rewind.engine.step.live import Parts
from rewind.engine.step.step import dropout_seed, micro_batches
from rewind.states.config import Config
from rewind.states.config_identity import config_hash
from rewind.states.events import ActivationsCached
from rewind.states.plan import CacheTrunk
from rewind.states.state import State
from rewind.stores import cachenames
from rewind.stores.activations import ActivationCache, CacheError, CacheSpec
from rewind.stores.cachebinding import cache_identity
from rewind.stores.cachenames import CACHE_DIR
from rewind.stores.confine import NotConfined
from rewind.stores.fsio import filesystem


def cache_path(version: int, first_step: int, config: Config) -> str:
    """Where the cache of trunk `version` for the steps from `first_step` under `config` lives, relative
    to the run directory. All three name it: a config changed in place (a fork) changes what the trunk
    outputs for a step (data, dropout, seed, RoPE...), and a cache found at the path of another's would
    otherwise be taken for it."""
    return cachenames.cache_path(version, first_step, config_hash(config))


def write_cache(parts: Parts, state: State, intent: CacheTrunk) -> ActivationsCached:
    """Compute and store the trunk's outputs for the steps the intent covers; returns the record that
    says the cache is complete (not yet appended)."""
    config, model = parts.config, parts.model
    width = config.architecture.d_model
    dtype = "bfloat16" if _trunk_dtype(model) == torch.bfloat16 else "float32"
    batch = config.training.batch_size
    path = cache_path(intent.version, state.step, config)
    # Bound to what the log records (rewind.stores.cachebinding): a cache of another run
    # at this path, complete or not, has another spec, and `create` deletes it.
    identity = cache_identity(state, intent.version, state.step, intent.num_steps, intent.num_rows, path)
    spec = CacheSpec(
        num_rows=intent.num_rows, seq_len=config.architecture.block_size, width=width, dtype=dtype,
        rows_per_chunk=batch, identity=identity,
    )  # fmt: skip
    writer = is_writer()
    cache = None
    if writer:  # rank 0 writes the cache; every rank of a sharded run computes it (each forward is collective)
        _delete_others(parts.run_dir, path)
        cache = ActivationCache.create(cache_url(parts.run_dir, path), spec)
    missing = set(cache.missing_chunks()) if cache is not None else set(range(intent.num_steps))
    compute_all = in_sharded_run()
    cursors = dict(state.cursors)
    model.train()  # as the step computes it: dropout (if any) keyed by the step's seeds
    with torch.no_grad():
        for offset in range(intent.num_steps):
            k = state.step + offset
            plan = parts.schedule.step_plan(k)
            rows = step_rows(config, plan.rows, cursors, parts.datasets)  # never packed (states.growth)
            tokens, cursors = rows.tokens, rows.cursors
            if offset not in missing and not compute_all:
                continue  # written by a process that was stopped before the cache was complete
            inputs = tokens[:, :-1].to(model_device(model))
            outputs = []
            for index, rows in enumerate(micro_batches(inputs.shape[0], config.training.per_device_batch_size)):
                outputs.append(model.trunk_output(inputs[rows], dropout_seed=dropout_seed(config, k, index)))
            if cache is not None and offset in missing:
                cache.write_chunk(offset, torch.cat(outputs).contiguous().cpu())
    if cache is None:
        return shared_event(None)  # type: ignore[return-value]
    cache.mark_complete()
    return shared_event(ActivationsCached(
        step=state.step,
        tokens=state.tokens,
        version=intent.version,
        num_steps=intent.num_steps,
        num_rows=intent.num_rows,
        path=path,
        num_bytes=cache.num_bytes(),
    ))


def _delete_others(run_dir: str, keep: str) -> None:
    """Only the cache being written stays: the others hold trunks the run no longer has (or rows another
    config made). Records naming them stay valid history; a replay over their steps recomputes the trunk,
    to the same bits."""
    root = filesystem(run_dir).join(CACHE_DIR)
    if not root.exists():
        return
    for name in root.list_names():
        if name.endswith(".zarr") and f"{CACHE_DIR}/{name}" != keep:
            try:
                ActivationCache.open(cache_url(run_dir, f"{CACHE_DIR}/{name}")).delete()
            except (CacheError, NotConfined):
                continue  # not a cache rewind made whole, or not the run's: left for a person to look at


def _trunk_dtype(model) -> torch.dtype:
    """The dtype of the stream entering the last stack (the model's residual stream: the embedding's)."""
    return model.embed.weight.dtype
