"""The translation of an ABCD trainer YAML config into a rewind config (as TOML-ready builtins).

Each section is read key by key through `YamlConfig`, so that whatever was not read can be named as
having no counterpart. Keys the original reads but that mean nothing for training here (wandb, plots,
the cluster request, the tokenizer, dtypes, LoRA) carry their reason in `NO_COUNTERPART`; a key the
importer does not know at all is named as such. Choices that change what trains (the LR schedule, the
KL kind, dataset stubs) are said on stderr by the caller, from `Notes`.
"""

from __future__ import annotations

from typing import Any

from rewind.states.config import BUILTIN_DATASETS
from rewind.tools.errors import UsageError
from rewind.tools.import_schedule import lr_schedule, trainer_of
from rewind.tools.import_yaml import MISSING, Notes, YamlConfig, short_repr

NO_TRAINING_MEANING = "no training meaning"
NO_COUNTERPART = {
    "request": f"{NO_TRAINING_MEANING}: the cluster chips the original's launcher asks for",
    "tokenizer": "set [tokenizer] path to its tokenizer.json, or train_vocab_size to train one at the start; without "
    "either, text / jsonl / parquet documents are read as UTF-8 bytes (docs/data.md)",
    "logging/wandb": f"{NO_TRAINING_MEANING}: rewind writes its metrics next to the run's event log",
    "logging/plots": f"{NO_TRAINING_MEANING}: plot with `rewind timeline --plot` / `rewind schedule --plot`",
    "architecture/dtype": "rewind has no dtype setting in its config",
    "architecture/vram_calib_factor": "the original launcher's memory calibration",
    "optimization/lora": "LoRA trunks are not in rewind yet",
    "training/post_lora_tokens": "LoRA phase; note the original's LR schedule also spans these tokens",
    "training/post_lora_dataset": "LoRA phase: its datasets are not imported",
    "training/post_lora_fade": "LoRA phase",
    "training/skip_first_dataset_validation": "rewind validates at every validation_interval, in every stage",
}
UNKNOWN = "unknown to the importer"
# Original name -> rewind's [architecture] name.
ARCHITECTURE = {
    "n_embd": "d_model",
    "n_layers": "num_layers",
    "n_head": "num_heads",
    "block_size": "block_size",
    "vocab_size": "vocab_size",
}
STYLE_KINDS = {"PMD": "tokens", "PADDED": "jsonl"}  # packed pretraining text / padded examples
STYLE_NOTES = {"PMD": "", "PADDED": "; rewind packs JSONL documents into rows, it has no padded style"}
# The original's logging defaults (its trainer configs), for keys a YAML leaves out.
LOGGING_DEFAULTS = {"report_interval": 32, "checkpoint_interval": 1024, "validation_interval": 512}
FADE_CURVES = ("linear", "cosine", "sigmoid")
# The largest sampling rate read (rates are divided by their sum; a larger integer is not even a float).
_MAX_RATE = 1e300


def translate(cfg: YamlConfig, run_name: str, notes: Notes) -> dict[str, Any]:
    """The rewind config (builtins, in rewind's section order) for the YAML in `cfg`."""
    job = cfg.get("job", "str", None)
    _job_notes(job, notes)
    tokens = cfg.get("training/tokens", "ints", MISSING)
    if tokens is MISSING:
        raise UsageError(f"{cfg.source}: training/tokens: missing (the stage budgets in tokens)")
    training, data = _training(cfg, tokens, notes)
    optimization = {"lr": cfg.get("optimization/lr", "float", 3e-4)}
    for key in ("weight_decay", "beta1", "beta2"):
        value = cfg.get(f"optimization/{key}", "float", None)
        if value is not None:
            optimization[key] = value
    optimization.update(lr_schedule(cfg, job, len(tokens), notes))
    kl = _kl(cfg, job, len(tokens), notes)
    if kl:
        optimization["kl"] = kl
    config = {
        "run": {"name": run_name},
        "architecture": _architecture(cfg, notes),
        "training": training,
        "optimization": optimization,
        "logging": _logging(cfg, notes),
    }
    if data:
        config["data"] = data
    for path in cfg.unread():
        notes.none(path, NO_COUNTERPART.get(path, UNKNOWN))
    return config


def _job_notes(job: str | None, notes: Notes) -> None:
    if job is None:
        notes.say("job: absent: the LR schedule follows optimization/schedule alone")
        return
    family = next((f for f in ("mamba", "moe", "hybrid", "lact") if f"_{f}" in job.rsplit("/", 1)[-1]), None)
    if family:
        notes.none("job", f"{job} trains a {family} model; rewind trains a transformer of the sizes given")
    if job.endswith("_lora"):
        notes.say(
            f"job: {job} injects LoRA adapters after training/tokens; only the stages before are imported"
        )


def _architecture(cfg: YamlConfig, notes: Notes) -> dict[str, Any]:
    arch: dict[str, Any] = {}
    for key, name in ARCHITECTURE.items():
        value = cfg.get(f"architecture/{key}", "int", None)
        if value is not None:
            arch[name] = value
        else:
            notes.say(f"architecture/{key}: absent: rewind's default architecture.{name} applies")
    dropout = cfg.get("architecture/dropout", "float", None)
    if dropout is not None:
        arch["dropout"] = dropout
    if cfg.get("architecture/rope", "bool", True) is False:
        notes.none("architecture/rope", "rewind's attention always uses rotary position embeddings")
    if cfg.get("architecture/bias", "bool", False):
        notes.none("architecture/bias", "rewind's linear layers have no bias")
    return arch


def _training(cfg: YamlConfig, tokens: list[int], notes: Notes) -> tuple[dict[str, Any], dict[str, Any]]:
    batch_size = cfg.get("training/batch_size", "int", None)
    if batch_size is None:
        batch_size = 512
        notes.default("training/batch_size", batch_size)
    training: dict[str, Any] = {"batch_size": batch_size}
    per_device = cfg.get("training/per_device_batch_size", "int", -1)
    if per_device > 0 and batch_size % per_device:
        notes.say(
            f"training/per_device_batch_size: {per_device} does not divide batch_size {batch_size}; "
            "-1 written (one forward for the whole batch)"
        )
        per_device = -1
    # -1: the original derives it from the devices; rewind then runs the whole batch at once.
    training["per_device_batch_size"] = per_device
    training["tokens"] = tokens
    datasets, data = _datasets(cfg, len(tokens), notes)
    training["datasets"] = datasets
    rows = per_device if per_device > 0 else batch_size
    validation_rows = cfg.get("training/validation_steps", "int", None)
    if validation_rows is not None:
        # The original's validation_steps counts rows of one validation batch; rewind's counts batches.
        training["validation_steps"] = max(1, validation_rows // rows)
        notes.say(
            f"training/validation_steps: {validation_rows} rows -> training.validation_steps = "
            f"{training['validation_steps']} batches of {rows} rows"
        )
    evaluations = _evaluations(cfg, datasets, notes)
    if evaluations:
        training["evaluations"] = evaluations
    fade = _fade(cfg)
    if fade:
        training["fade"] = fade
    return training, data


def _datasets(cfg: YamlConfig, num_stages: int, notes: Notes) -> tuple[list, dict[str, Any]]:
    """training/dataset -> training.datasets; each dataset rewind does not have becomes a [data.NAME]
    stub: a name with a suffix is its own dataset (`name-suffix`)."""
    stages = cfg.raw("training/dataset")
    cfg.mark("training/dataset")
    if stages is MISSING:
        raise UsageError(f"{cfg.source}: training/dataset: missing (one list of datasets per stage)")
    if not isinstance(stages, list) or not all(isinstance(s, list) for s in stages):
        raise cfg.fail(
            "training/dataset", "a list (one per stage) of lists of {name, rate, style, suffix}", stages
        )
    if len(stages) != num_stages:
        raise UsageError(
            f"{cfg.source}: training/dataset: {len(stages)} stages, but training/tokens has {num_stages}"
        )
    mixtures, data, origin, builtins_said = [], {}, {}, set()
    for i, stage in enumerate(stages):
        mixture = []
        for j, entry in enumerate(stage):
            path = f"training/dataset[{i}][{j}]"
            name, suffix, style, rate = _sampling(cfg, path, entry, notes)
            key = f"{name}-{suffix}" if suffix else name
            if origin.setdefault(key, (name, suffix, style)) != (name, suffix, style):
                raise UsageError(
                    f"{cfg.source}: {path}: {short_repr(key)} also names a dataset of another name, suffix or style"
                )
            if key in BUILTIN_DATASETS:
                if key not in builtins_said:
                    builtins_said.add(key)
                    notes.say(f"{path}: {key!r} is rewind's built-in synthetic dataset of that name")
            elif key not in data:
                kind = STYLE_KINDS.get(style.upper(), "jsonl")
                data[key] = {"kind": kind, "path": f"FILL-ME/{key}.{'bin' if kind == 'tokens' else 'jsonl'}"}
                why = STYLE_NOTES.get(style.upper(), f"; style {style!r} has no counterpart")
                shown = f"{name} (suffix {suffix})" if suffix else name
                notes.say(
                    f"{path}: {shown}, {style}: rewind has no such dataset: [data.{key}] is a stub "
                    f"(kind {kind}), fill in its path{why}"
                )
            mixture.append({"name": key, "rate": rate})
        total = sum(s["rate"] for s in mixture)
        if mixture and abs(total - 1.0) > 1e-9:
            for s in mixture:
                s["rate"] = s["rate"] / total
            notes.say(
                f"training/dataset[{i}]: rates sum to {total:g}; divided by it (rewind's must sum to 1)"
            )
        mixtures.append(mixture)
    return mixtures, data


def _sampling(cfg: YamlConfig, path: str, entry: Any, notes: Notes) -> tuple[str, str, str, float]:
    if not isinstance(entry, dict):
        raise cfg.fail(path, "a mapping {name, rate, style, suffix}", entry)
    for key in entry:
        if key not in ("name", "rate", "style", "suffix"):
            notes.none(f"{path}/{key}", UNKNOWN)
    name, suffix, style = entry.get("name"), entry.get("suffix") or "", entry.get("style") or "PMD"
    rate = entry.get("rate", 1.0)
    if not isinstance(name, str) or not name:
        raise cfg.fail(f"{path}.name", "a dataset name", name)
    if not isinstance(suffix, str):
        raise cfg.fail(f"{path}.suffix", "a string", suffix)
    if not isinstance(style, str):
        raise cfg.fail(f"{path}.style", "PMD or PADDED", style)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0 or rate > _MAX_RATE:
        raise cfg.fail(f"{path}.rate", "a positive number", rate)
    return name, suffix, style, float(rate)


def _evaluations(cfg: YamlConfig, datasets: list, notes: Notes) -> list[str]:
    names = cfg.get("eval/evaluations", "strs", [])
    known = {s["name"] for mixture in datasets for s in mixture}
    kept = []
    for k, name in enumerate(names):
        if name in known:
            kept.append(name)
        else:
            notes.none(
                f"eval/evaluations[{k}]",
                f"{name!r} is not a dataset of this config; rewind evaluates datasets",
            )
    return kept


def _fade(cfg: YamlConfig) -> dict[str, Any]:
    fade: dict[str, Any] = {}
    for key, kind in (
        ("overlap", "float"),
        ("curve", "str"),
        ("steepness", "float"),
        ("per_boundary_overlap", "floats"),
    ):
        value = cfg.get(f"training/fade/{key}", kind, None)
        if value is not None:
            fade[key] = value
    if fade.get("curve", "linear") not in FADE_CURVES:
        raise cfg.fail("training/fade/curve", " or ".join(FADE_CURVES), fade["curve"])
    return fade


def _kl(cfg: YamlConfig, job: str | None, num_stages: int, notes: Notes) -> dict[str, Any]:
    """optimization/kl -> optimization.kl, for the jobs whose trainer reads it."""
    trainer = trainer_of(job)
    paths = ("optimization/kl/betas", "optimization/kl/reference_update_stages")
    if trainer in ("abcd", "benchmark"):
        for path in paths:
            cfg.mark(path)
            if cfg.has(path):
                notes.none(path, f"job {job} does not read it: the original trains without a KL penalty")
        return {}
    betas = cfg.get(paths[0], "floats", None)
    stages = cfg.get(paths[1], "ints", None)
    if trainer == "abcd_kl":
        if betas is None:
            betas = [0.0] + [0.1] * (num_stages - 1)
            notes.default(paths[0], betas)
        if stages is None:
            stages = [1] if num_stages > 1 else []
            notes.default(paths[1], stages)
    if cfg.has("optimization/kl/beta"):
        cfg.mark("optimization/kl/beta")
        notes.none(
            "optimization/kl/beta",
            "the two-stage KL trainer's single beta; write each stage's beta",
        )
    if not betas and not stages:
        return {}
    kl: dict[str, Any] = {
        "betas": betas or [],
        "reference_update_stages": stages or [],
        "kind": "nll_difference",
    }
    notes.say(
        "optimization/kl: kind = nll_difference, the original's policy_loss - stop_grad(reference_loss), whose "
        "gradient is (1 + beta) x the task gradient (the reference never shapes training); "
        'set optimization.kl.kind = "token_kl" for a KL penalty that does'
    )
    if 0 in (stages or []):
        notes.say(
            "optimization/kl/reference_update_stages: stage 0 never refreshes in the original (no boundary enters "
            "it); rewind takes the initial weights as the reference there"
        )
    early = [i for i, b in enumerate(betas or []) if b > 0 and not any(r <= i for r in stages or [])]
    if early:
        notes.say(
            f"optimization/kl/betas: stages {early} have beta > 0 before any reference: the original penalises "
            "against an all-zero model there, rewind trains them without KL (add 0 to reference_update_stages "
            "for a reference from the start)"
        )
    return kl


def _logging(cfg: YamlConfig, notes: Notes) -> dict[str, Any]:
    logging: dict[str, Any] = {}
    for key, default in LOGGING_DEFAULTS.items():
        value = cfg.get(f"logging/{key}", "int", None)
        if value is None:
            value = default
            notes.default(f"logging/{key}", default)
        logging[key] = value
    if cfg.get("training/validation", "bool", True) is False:
        logging["validation_interval"] = 0
        notes.say("training/validation: false -> logging.validation_interval = 0 (no validation losses)")
    if cfg.get("training/evaluate", "bool", False):
        notes.none(
            "training/evaluate",
            "the original also evaluates at every validation interval; rewind evaluates at stage boundaries and the end",
        )
    return logging
