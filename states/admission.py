"""Whether a record may be accepted: the content checks of what a log carries, beside the fold that
accepts it. Pure (no I/O): `rewind.stores.trust` applies them to every record a reader takes from a log.

The fold (rewind.states.fold) checks that each event may follow the state before it. It does not check
what a record carries for later use: a RunStarted's config is adopted as it decodes (batch_size = 0
divides by zero in the schedule, num_threads = 100000 crashes the OpenMP runtime), and checkpoint names,
file names, dataset names and activation cache paths become paths, which must stay inside the run.
`Admission` holds every record to the rules a user's own input meets (a config gets the same
`check_config` as a config file) and says what the first one that breaks them carries wrong.
A fork's seed (RunResumed.seed) is the parent's state, which the child's log cannot derive: the fold
range-checks it; here it is also held to the run's length and to what its step could have consumed.

An ActivationsCached record names its cache by a path relative to the run directory, and a log is
untrusted input (a CRC is not a signature): a forged path could lead a resume to train on another run's
cache, which is as consistent as its own. So a record's path must be a name rewind writes, of the
record's own trunk version and first step:

    cache/trunk-<version>-<first step:08d>-<config hash, 12 hex digits>.zarr   runs of this release
    cache/trunk-<version>.zarr                                                 the first runs with growth

and "" (a dry-run's record: no cache). Where the name leads once links are resolved is checked where
the cache is opened (rewind.engine.run.trunkcache).
"""

from __future__ import annotations

import re

from rewind.states.check_stages import MAX_STAGES
from rewind.states.config import Config
from rewind.states.config_rules import check_config
from rewind.states.events import (
    RUN_FEATURES,
    ActivationsCached,
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    Event,
    ForkOrigin,
    ReferenceRefreshed,
    RolloutsRecorded,
    RunResumed,
    RunStarted,
    StepCommitted,
)
from rewind.states.schedule import Schedule
from rewind.states.state import ForkSeed, State

# More CPU threads than any machine rewind runs on has: a recorded count beyond it is not a real run's,
# and handing it to torch.set_num_threads crashes the OpenMP runtime.
MAX_THREADS = 1024
_CHECKPOINT_NAME = re.compile(r"(\d{8,})-[0-9a-f]{8}")
_FILE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\.safetensors")


# --- names a record may give what rewind writes ----------------------------------------------------


def plain_name_problem(name: object) -> str:
    """Why `name` is not a plain file or directory name ("" when it is one)."""
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a name"
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        return f"{name!r} is not a plain name (a path, '..' or '.')"
    return ""


CACHE_DIR = "cache"
_CACHE_PATH = re.compile(r"cache/trunk-(\d{1,9})(?:-(\d{8,12})-[0-9a-f]{12})?\.zarr", re.ASCII)


def cache_path_problem(path: object, version: int, step: int) -> str:
    """Why `path` cannot be the cache an ActivationsCached(version, step) names ("" if it can)."""
    if path == "":
        return ""
    match = _CACHE_PATH.fullmatch(path) if isinstance(path, str) else None
    if match is None:
        return (
            f"activation cache path {str(path)[:80]!r} is not one rewind writes "
            f"({CACHE_DIR}/trunk-<version>-<step>-<config>.zarr, inside the run)"
        )
    if int(match.group(1)) != version or (match.group(2) is not None and int(match.group(2)) != step):
        return f"activation cache path {path} is not the cache of its record's trunk {version} at step {step}"
    return ""


ROLLOUTS_DIR = "rollouts"
_ROLLOUT_PATH = re.compile(r"rollouts/([0-9a-f]{64})\.safetensors", re.ASCII)


def rollout_path_problem(path: object, sha256: object) -> str:
    """Why `path` cannot be the rollout file a RolloutsRecorded names by `sha256` ("" if it can): only
    RUN/rollouts/<its sha256>.safetensors, so a forged record cannot lead a reader out of the run."""
    match = _ROLLOUT_PATH.fullmatch(path) if isinstance(path, str) else None
    if match is None:
        return f"rollout path {str(path)[:80]!r} is not one rewind writes ({ROLLOUTS_DIR}/<sha256>.safetensors)"
    if match.group(1) != sha256:
        return f"rollout path {path} is not named by its recorded sha256 {str(sha256)[:80]!r}"
    return ""


# --- what a record carries ---------------------------------------------------------------------------


def config_problem(config: Config) -> str:
    """The first thing `check_config` finds wrong with a config carried by a record ("" if none), or a
    dataset name that is not a plain name (it names a directory under RUN/data)."""
    problems = check_config(config)
    problems += [f"data.{name[:80]!r}: {why}" for name in config.data if (why := plain_name_problem(name))]
    if not problems:
        return ""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"its config is not one rewind accepts: {problems[0]}{more}"


_CAPABILITY = re.compile(r"[A-Za-z0-9_]{0,16}")


def capability_problem(capability: str) -> str:
    """A CPU capability is a short name (it goes into ATEN_CPU_CAPABILITY)."""
    return (
        ""
        if _CAPABILITY.fullmatch(capability)
        else f"cpu_capability {capability[:40]!r} is not a capability name"
    )


def features_problem(features: list[str]) -> str:
    """A run started by a newer release may do something this one cannot (a behaviour it gates on a
    feature name): resuming or replaying it here would silently compute something else."""
    unknown = [name for name in features if name not in RUN_FEATURES]
    if not unknown:
        return ""
    return f"the run was started with behaviours this release does not have ({', '.join(unknown[:3])}): use a newer rewind"


def threads_problem(num_threads: int) -> str:
    if 0 <= num_threads <= MAX_THREADS:
        return ""
    return f"num_threads {num_threads} is out of range 0..{MAX_THREADS}"


# torchrun's own limit is far lower; this only keeps absurd values out of what sizes a process group.
MAX_WORLD_SIZE = 1 << 20
_DEVICE = re.compile(r"(cpu|cuda(:[ -~]{0,80})?)?")


def placement_problem(device: str, world_size: int) -> str:
    """A recorded device is "", "cpu" or "cuda[:name]" and a world size is in 0..MAX_WORLD_SIZE."""
    if not 0 <= world_size <= MAX_WORLD_SIZE:
        return f"world_size {world_size} is out of range 0..{MAX_WORLD_SIZE}"
    if not _DEVICE.fullmatch(device):
        return f"device {device[:40]!r} is not a device rewind computes on"
    return ""


def state_problem(state: State, config: Config) -> str:
    """Why a cached state (a snapshot) cannot be used ("" if it can): the same rules as the records."""
    cache = state.activation_cache
    return (
        config_problem(config)
        or threads_problem(state.num_threads)
        or capability_problem(state.cpu_capability)
        or placement_problem(state.device, state.world_size)
        or (cache_path_problem(cache.path, cache.version, cache.step) if cache is not None else "")
    )


def _name_problem(name: str, step: int | None, *, empty_ok: bool) -> str:
    if empty_ok and name == "":
        return ""
    match = _CHECKPOINT_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return f"{name!r} is not a checkpoint name (<step:08d>-<8 hex digits>)"
    if step is not None and int(match.group(1)) != step:
        return f"checkpoint {name} is named for step {int(match.group(1))}, not {step}"
    return ""


def _files_problem(files: dict[str, str]) -> str:
    bad = [name for name in files if not _FILE_NAME.fullmatch(name)]
    return f"file name {bad[0]!r} is not a plain <group>.safetensors name" if bad else ""


# A fork's parent is only ever shown (rewind never reads it): a path or URL of printable characters.
_SHOWN_PATH = re.compile(r"[^\x00-\x1f\x7f]{0,4096}")


def _parent_problem(parent: ForkOrigin | None) -> str:
    if parent is None:
        return ""
    if not _SHOWN_PATH.fullmatch(parent.run):
        return "its parent run's path holds control characters or is too long"
    problem = _name_problem(parent.checkpoint, parent.step if parent.checkpoint else None, empty_ok=True)
    return f"its parent's checkpoint: {problem}" if problem else ""


# The records whose contents a reader acts on beyond folding them (a config, names that become paths,
# a fork's seed): what every read of a log checks. The rest are checked where they are folded into a
# live run (stores.folding), which is where a negative cursor could do harm.
CARRIERS = (
    RunStarted,
    ConfigChanged,
    RunResumed,
    CheckpointCommitted,
    CheckpointDeleted,
    ReferenceRefreshed,
    ActivationsCached,
    RolloutsRecorded,
)


class Admission:
    """Admits records in log order, keeping the config in force (a seed is checked against it)."""

    def __init__(self, config: Config | None = None):
        self.config = config

    def problem(self, event: Event) -> str:
        """What `event` carries that no rewind run could have written ("" if nothing): the first problem."""
        if event.step < 0 or event.tokens < 0:
            return "step and tokens must be >= 0"
        match event:
            case RunStarted():
                problem = (
                    config_problem(event.config)
                    or threads_problem(event.num_threads)
                    or capability_problem(event.cpu_capability)
                    or features_problem(event.features)
                    or placement_problem(event.device, event.world_size)
                    or _parent_problem(event.parent)
                )
                if not problem:
                    self.config = event.config
                return problem
            case ConfigChanged():
                problem = config_problem(event.config)
                if not problem:
                    self.config = event.config
                return problem
            case StepCommitted(cursors=cursors):
                negative = [name for name, value in cursors.items() if value < 0]
                return f"data cursor {negative[0]!r} is negative" if negative else ""
            case CheckpointCommitted():
                return _name_problem(event.checkpoint, event.step, empty_ok=False) or _files_problem(
                    event.files
                )
            case ActivationsCached():
                return cache_path_problem(event.path, event.version, event.step)
            case RolloutsRecorded(cursors=cursors):
                negative = [name for name, value in cursors.items() if value < 0]
                return rollout_path_problem(event.path, event.sha256) or (
                    f"data cursor {negative[0]!r} is negative" if negative else ""
                )
            case CheckpointDeleted() | ReferenceRefreshed():
                return _name_problem(event.checkpoint, None, empty_ok=isinstance(event, ReferenceRefreshed))
            case RunResumed():
                problem = (
                    _name_problem(event.checkpoint, event.step if event.checkpoint else None, empty_ok=True)
                    or placement_problem(event.device, event.world_size)
                    or threads_problem(event.num_threads)
                )
                if problem or event.seed is None:
                    return problem
                return self._seed_problem(event, event.seed)
        return ""

    def _seed_problem(self, event: RunResumed, seed: ForkSeed) -> str:
        # The run's length: the seed's own, else the config's (unknown to a reader starting mid-log).
        num_steps = seed.num_steps or (Schedule(self.config).num_steps if self.config is not None else None)
        if num_steps is not None and event.step > num_steps:
            return f"the fork seed's step {event.step} is past the run's end (step {num_steps})"
        if seed.num_stages > MAX_STAGES or max(map(len, _stage_lists(seed))) > MAX_STAGES:
            return f"the fork seed holds more than {MAX_STAGES:,} stages (the most a config may have)"
        if any(value < 0 for value in seed.cursors.values()):
            return "the fork seed's data cursors must be >= 0"
        # Every sample drawn is at least one token of those the steps consumed.
        if sum(seed.cursors.values()) > event.tokens:
            return f"the fork seed's data cursors add up to more samples than its {event.tokens} tokens hold"
        if not (0 <= seed.num_skipped_steps <= event.step and seed.last_validated_step <= event.step):
            return "the fork seed's step counts are not within its step"
        for ref in seed.live_checkpoints:
            problem = _name_problem(ref.checkpoint, ref.step, empty_ok=False) or _files_problem(ref.files)
            if problem or not 0 <= ref.step <= event.step:
                return f"the fork seed's checkpoint list: {problem or f'{ref.checkpoint} is not within its step'}"
        if seed.reference is not None and (
            problem := _name_problem(seed.reference.checkpoint, None, empty_ok=False)
        ):
            return f"the fork seed's reference: {problem}"
        if seed.rollouts is not None and (problem := rollout_path_problem(seed.rollouts.path, seed.rollouts.sha256)):
            return f"the fork seed's rollout batch: {problem}"
        return ""


def _stage_lists(seed: ForkSeed) -> tuple[list[int], ...]:
    """The seed's lists of stages and boundaries: each has at most one entry per stage."""
    return (
        seed.reference_update_stages,
        seed.fades_started,
        seed.fades_ended,
        seed.pending_refreshes,
        seed.pending_optimizer_resets,
    )
