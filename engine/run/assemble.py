"""The live objects of an entry into a run, built one way for every entry point that computes (start,
resume, fork, replay; the decision of what to enter is rewind.states.entry's, and
rewind.engine.run.entry.enter carries it out through here).

`adopt_site` adopts where the run computes (CPU kernels, device, thread count) before the first tensor
(`enter_site` also refuses what this process cannot compute); `assemble` checks the data the run
recorded and opens its datasets, then builds model, optimizer, reference and caches from the folded
state and its checkpoint (rewind.engine.run.parts.build_parts) or, at a run's start, from the seed or the
pretrained weights. The read-only opens adopt the site here too: sample and eval then load only the
checkpoint's model (rewind.engine.model.checkpoint_model.load_model); export computes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rewind.engine.data.rundata import DataChanged, check_data
from rewind.engine.data.userdata import DataHome
from rewind.engine.model.placement import (
    Placement,
    adopt_cpu_capability,
    adopt_device,
    adopt_threads,
    check_compute,
    forget_adopted_device,
    join_process_group,
    placement_for,
    prepare_device,
)
from rewind.engine.run.parts import Parts, RunError, build_parts, fresh_parts, open_datasets, starting_weights
from rewind.engine.step.kinds import KindError, spec_of
from rewind.states.config import ComputeSection, Config
from rewind.states.cpu_threads import threads_worth
from rewind.states.entry import Site
from rewind.states.state import State


def adopt_site(site: Site | None, threads: int = 0) -> str:
    """Compute where the run computes: a new run (`site` None) where this process is, with its own thread
    count or `threads` (> 0: the user's --threads); an existing one with the CPU kernels, device and
    thread count on record (or `threads`). Returns what the user should know about the thread count ("":
    nothing). Must run before the first tensor is computed (torch fixes its CPU kernels then)."""
    if site is None:
        forget_adopted_device()  # not one a resume earlier in this process adopted
        return adopt_threads(0, threads)
    adopt_cpu_capability(site.cpu_capability)
    note = adopt_threads(site.num_threads, threads)
    adopt_device(site.device, or_cpu=site.reading)
    return note


def enter_site(
    config: Config, site: Site | None, threads: int = 0, *, join: ComputeSection | None = None
) -> tuple[Placement, str]:
    """Adopt `site` (`adopt_site`), join the process group `join` asks for (None: none; after the site,
    so that compute.device = "auto" resolves to the device adopted), and refuse what this process cannot
    compute as `config` asks (PlacementError), with the process-wide settings its device needs made:
    (placement, note). A new run without --threads computes with the threads its steps keep busy, up to
    this process's count (rewind.states.cpu_threads)."""
    if site is None and threads <= 0:
        threads = threads_worth(config, torch.get_num_threads())
    note = adopt_site(site, threads)
    if join is not None:
        join_process_group(join)
    placement = placement_for(config)
    check_compute(config, placement)
    prepare_device(config)
    return placement, note


@dataclass(frozen=True)
class Assembled:
    parts: Parts
    pretrained: str  # the identity of the weights the run started from ("": the seed's)


def assemble(
    config: Config,
    run_dir: str,
    state: State | None,
    home: DataHome,
    *,
    recorded: Config | None = None,
    checked: State | None = None,
) -> Assembled:
    """The live objects of `config` at `state` (None: a run's start, from the seed's or the pretrained
    weights), reading the data at `home`, in the process `enter_site` prepared. The data the run
    recorded is checked first (DataChanged), as `recorded` declares it (default `config`) against
    `checked`'s record (default `state`'s); then the datasets are opened and the objects built (a
    checkpoint that does not load: CheckpointError)."""
    if state is not None:
        changes = check_data(recorded or config, checked or state, home)
        if changes:
            raise DataChanged(changes)
    try:
        datasets = open_datasets(config, home)
    except KindError as exc:  # the config names it wrongly (a start), or the run's code is gone (1)
        raise RunError(str(exc), 2 if state is None else 1) from None
    if state is None:
        pretrained = starting_weights(config, None)
        parts = fresh_parts(config, run_dir, datasets, pretrained)
        return Assembled(parts, pretrained.identity if pretrained is not None else "")
    parts = build_parts(config, run_dir, state, datasets)
    if state.rollouts is not None and 0 <= state.stage < config.num_stages:
        try:  # the batch a rollout stage's window holds still reads as its record says
            spec_of(config.stages[state.stage]).check_held(parts, state)
        except KindError as exc:
            raise RunError(str(exc), exc.exit_code) from None
    return Assembled(parts, state.pretrained)
