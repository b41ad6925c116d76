"""Which learning-rate schedule an imported ABCD config trains with, and why.

In the original the job, not `optimization/schedule`, picks the trainer and so the LR curve:
- `continual/train/abcd` and `abcd_kl`: wsds, whatever `optimization/schedule` says;
- `continual/train/benchmark*`: wsd whose warmup starts and whose decay ends at 0.01 x lr (hard-coded,
  so `warmup_lr_mult` / `decay_lr_mult` are not read), whatever `optimization/schedule` says, so a
  config asking for `cosine_rewarm` trains with wsd there; `reset_optimizer: true` re-initialises the
  optimizer (moments and the step count that drives the LR) at every dataset boundary;
- any other job: `optimization/schedule` as written (`cosine_rewarm` maps to rewind's schedule of
  that name, `wsd_reset` with `reset_optimizer: true` to wsd with a reset at every boundary).
"""

from __future__ import annotations

from typing import Any

from rewind.tools.errors import UsageError
from rewind.tools.import_yaml import Notes, YamlConfig, short_repr

# Defaults of the original's ABCD trainer config (ABCDConfig), for keys a YAML leaves out.
ABCD_DEFAULTS = {"warmup_pct": 0.01, "decay_pct": 0.01, "constant_pct": 0.30}
# Defaults of the original's wsds and cosine_rewarm schedule configs.
WSDS_MULT_DEFAULTS = {"warmup_lr_mult": 0.01, "decay_lr_mult": 0.1}
REWARM_DEFAULTS = {"warmup_pct": 0.01, "rewarm_lr": 1e-4, "min_lr_mult": 0.01}
BENCHMARK_WSD_END_MULT = 0.01  # the benchmark trainer's wsd: warmup from and decay to 0.01 x lr
KNOWN_SCHEDULES = ("wsd", "wsds", "wsd_reset", "cosine_rewarm")


def trainer_of(job: str | None) -> str:
    """'abcd_kl', 'abcd', 'benchmark' or 'other': the trainer family a job name selects."""
    if job is None:
        return "other"
    if job.startswith("continual/train/abcd_kl"):
        return "abcd_kl"
    if job.startswith("continual/train/abcd"):
        return "abcd"
    if job.startswith("continual/train/benchmark"):
        return "benchmark"
    return "other"


def lr_schedule(cfg: YamlConfig, job: str | None, num_stages: int, notes: Notes) -> dict[str, Any]:
    """The `[optimization]` keys that shape the LR (schedule name, phases, multipliers, resets)."""
    trainer = trainer_of(job)
    asked = cfg.get("optimization/schedule", "str", None)
    reset = cfg.get("optimization/reset_optimizer", "bool", None)
    resets = False
    if trainer in ("abcd", "abcd_kl"):
        name, why = "wsds", f"job {job} trains with wsds whatever optimization/schedule says"
        if asked not in (None, "wsds"):
            notes.none("optimization/schedule", f"job {job} does not read it: its trainer always uses wsds")
        if reset is not None:
            notes.none(
                "optimization/reset_optimizer", f"only the benchmark trainers read it; job {job} never resets"
            )
    elif trainer == "benchmark":
        name = "wsd"
        why = (
            f"job {job}: the benchmark trainer uses wsd, warmup from and decay to "
            f"{BENCHMARK_WSD_END_MULT} x lr, whatever optimization/schedule says"
        )
        if asked not in (None, "wsd", "wsd_reset"):
            why += f", so {asked} trains with wsd there"
        resets = bool(reset) and asked != "cosine_rewarm"
    else:
        if asked is None:
            name = "wsds"
            why = f"{'job ' + job if job else 'no job'} and no optimization/schedule: wsds, the ABCD trainers' schedule"
        elif asked in KNOWN_SCHEDULES:
            name = "wsd" if asked == "wsd_reset" else asked
            why = f"optimization/schedule: {asked}"
        else:
            raise UsageError(
                f"{cfg.source}: optimization/schedule: {short_repr(asked)} is not a schedule the importer knows "
                f"({', '.join(KNOWN_SCHEDULES)})"
            )
        resets = asked == "wsd_reset" and bool(reset)
    if asked == "wsd_reset" and not reset:
        notes.say(
            "optimization/schedule: wsd_reset without optimization/reset_optimizer: true resets nothing in the original: plain wsd"
        )

    notes.headline(f"lr schedule: {name} ({why})")
    opt = _shape(cfg, name, trainer, notes)
    if resets and num_stages > 1:
        opt["reset_optimizer_stages"] = list(range(1, num_stages))
        opt["reset_restarts_lr"] = True
        notes.say(
            "optimization/reset_optimizer: true -> reset_optimizer = true in every stage after the first, "
            "reset_restarts_lr = true: the original's tx.init at each boundary clears the moments and the "
            "step count that drives its LR, so the LR it applies restarts from warmup (its logged LR does not)"
        )
    return opt


def _shape(cfg: YamlConfig, name: str, trainer: str, notes: Notes) -> dict[str, Any]:
    """The phase lengths and multipliers of schedule `name`; the keys it does not read are named."""
    opt: dict[str, Any] = {"schedule": name}

    def take(key: str, default: float, into: str | None = None) -> None:
        path = f"optimization/{key}"
        value = cfg.get(path, "float", None)
        if value is None:
            value = default
            notes.default(path, default)
        opt[into or key] = value

    def unread(*keys: str, why: str) -> None:
        for key in keys:
            path = f"optimization/{key}"
            cfg.mark(path)
            if cfg.has(path):
                notes.none(path, why)

    if name == "cosine_rewarm":
        take("warmup_pct", REWARM_DEFAULTS["warmup_pct"])
        take("rewarm_lr", REWARM_DEFAULTS["rewarm_lr"])
        take("min_lr_mult", REWARM_DEFAULTS["min_lr_mult"], into="min_lr_ratio")
        unread(
            "decay_pct",
            "constant_pct",
            "warmup_lr_mult",
            "decay_lr_mult",
            why="cosine_rewarm does not read it",
        )
        return opt
    take("warmup_pct", ABCD_DEFAULTS["warmup_pct"])
    take("decay_pct", ABCD_DEFAULTS["decay_pct"])
    if name == "wsds":
        take("constant_pct", ABCD_DEFAULTS["constant_pct"])
        take("warmup_lr_mult", WSDS_MULT_DEFAULTS["warmup_lr_mult"])
        take("decay_lr_mult", WSDS_MULT_DEFAULTS["decay_lr_mult"])
    else:
        opt["warmup_lr_mult"] = opt["decay_lr_mult"] = BENCHMARK_WSD_END_MULT
        unread("constant_pct", why="wsd has no second stable phase; the original's wsd does not read it")
        unread(
            "warmup_lr_mult",
            "decay_lr_mult",
            why=f"the original's wsd hard-codes {BENCHMARK_WSD_END_MULT} x lr",
        )
    unread("rewarm_lr", "min_lr_mult", why=f"only cosine_rewarm reads it; this config trains with {name}")
    return opt
