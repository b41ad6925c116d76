"""`rewind import-config`: ABCD trainer YAML configs (fixtures/theseus) translated into rewind configs
that `rewind schedule` accepts, with every key that has no counterpart named on stderr."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from rewind.states.events import StageEntered
from rewind.states.plan import plan
from rewind.states.schedule import Schedule
from rewind.tools.configfile import load_config

THESEUS = Path(__file__).parent / "fixtures" / "theseus"
FIXTURES = sorted(p.name for p in THESEUS.glob("*.yaml"))
NO_COUNTERPART = re.compile(r"^rewind: import: (\S+): no counterpart \((.+)\)$")


@pytest.fixture
def imported(rewind_cli, tmp_path):
    """Import a YAML config: (the TOML file written, its parsed dict, {yaml path: why} of the keys
    named as having no counterpart, every stderr line)."""

    def run(source: Path | str):
        code, out, err = rewind_cli("import-config", source)
        assert code == 0, err
        lines = err.splitlines()
        assert all(line.startswith("rewind: import: ") for line in lines), lines
        toml = tmp_path / (Path(source).stem + ".toml")
        toml.write_text(out, encoding="utf-8")
        named = {m[1]: m[2] for m in map(NO_COUNTERPART.match, lines) if m}
        return toml, tomllib.loads(out), named, lines

    return run


def stage_indices(config: dict, key: str) -> list[int]:
    """The stages whose record sets `key` (refresh_reference, reset_optimizer) in an imported config."""
    return [i for i, stage in enumerate(config["stages"]) if stage.get(key)]


def write_yaml(tmp_path: Path, text: str, name: str = "theseus.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


MINIMAL = """\
job: continual/train/abcd
training:
  batch_size: 8
  tokens: [8192, 4096]
  dataset:
  - - {name: grammar, rate: 1.0, style: PMD}
  - - {name: sort, rate: 1.0, style: PADDED}
architecture: {block_size: 64, n_embd: 64, n_head: 4, n_layers: 2, vocab_size: 256}
"""


@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_fixture_becomes_a_config_rewind_schedule_accepts(fixture, imported, rewind_cli):
    toml, config, _, lines = imported(THESEUS / fixture)
    code, _, err = rewind_cli("schedule", toml, "--check")
    assert code == 0, err
    events = list(plan(Schedule(load_config(toml))))
    entered = [e.stage for e in events if isinstance(e, StageEntered)]
    assert entered == list(range(len(config["stages"])))
    assert "tokens" not in config["training"]  # written as [[stages]] records, not the flat lists
    assert sum("lr schedule: " in line for line in lines) == 1
    assert "lr schedule: " in lines[0]  # the choice that shapes the whole run is said first


def test_abcd_kl_job_trains_wsds_with_the_original_kl_and_stub_datasets(imported):
    toml, config, named, lines = imported(THESEUS / "abcd_kl_fade.yaml")
    arch, training, opt = config["architecture"], config["training"], config["optimization"]
    assert (arch["d_model"], arch["num_layers"], arch["num_heads"], arch["block_size"]) == (256, 4, 8, 512)
    assert opt["lr"] == 3e-4  # written `3e-4`, a string to YAML 1.1, read as the number it means
    # The job, not optimization/schedule (cosine_rewarm here), picks wsds.
    assert opt["schedule"] == "wsds"
    assert (opt["warmup_pct"], opt["decay_pct"], opt["constant_pct"]) == (0.05, 0.10, 0.02)
    assert lines[0].startswith("rewind: import: lr schedule: wsds (job continual/train/abcd_kl")
    assert "optimization/schedule" in named
    assert opt["kl"] == {"kind": "nll_difference"}
    assert [stage["beta"] for stage in config["stages"]] == [0.0, 0.1, 0.1, 0.2]
    assert stage_indices(config, "refresh_reference") == [1]
    # Rates 3 and 1 are normalised; each dataset rewind lacks is a stub of the kind its style suggests.
    assert config["stages"][1]["datasets"] == [{"name": "mnli", "rate": 0.75}, {"name": "fineweb", "rate": 0.25}]
    assert config["data"]["fineweb"]["kind"] == "tokens" and config["data"]["mnli"]["kind"] == "jsonl"
    assert sum("[data.mnli] is a stub" in line for line in lines) == 1
    assert training["evaluations"] == ["mnli", "qqp"]
    assert "fineweb_ppl" in named["eval/evaluations[2]"]
    # 2048 validation rows at 16 rows per forward are 128 of rewind's validation batches.
    assert training["validation_steps"] == 128
    assert training["fade"] == {"overlap": 0.2, "curve": "cosine", "steepness": 10.0}
    loaded = load_config(toml)
    assert loaded.optimization.kl.kind == "nll_difference" and loaded.training.per_device_batch_size == 16


def test_keys_without_training_meaning_and_unknown_keys_are_each_named_once(imported):
    _, _, named, lines = imported(THESEUS / "abcd_kl_fade.yaml")
    for path in ("logging/wandb", "logging/plots", "request"):
        assert "no training meaning" in named[path]
    assert named["logging/frobnicate"] == "unknown to the importer"
    for path in ("tokenizer", "architecture/bias", "architecture/vram_calib_factor", "training/evaluate"):
        assert path in named
    # A section is named as a whole, not leaf by leaf; each path once.
    assert not any(p.startswith(("request/", "tokenizer/")) for p in named)
    paths = [m[1] for m in map(NO_COUNTERPART.match, lines) if m]
    assert len(paths) == len(set(paths))


def test_benchmark_job_trains_wsd_with_hard_coded_end_multipliers_whatever_it_asks(imported):
    toml, config, named, lines = imported(THESEUS / "benchmark_cosine_rewarm.yaml")
    opt = config["optimization"]
    assert opt["schedule"] == "wsd"
    assert opt["warmup_lr_mult"] == opt["decay_lr_mult"] == 0.01
    assert "cosine_rewarm trains with wsd" in lines[0]
    assert "only cosine_rewarm reads it" in named["optimization/rewarm_lr"]
    assert "constant_pct" not in opt and "optimization/constant_pct" in named
    assert "reset_optimizer_stages" not in opt and stage_indices(config, "reset_optimizer") == []
    schedule = Schedule(load_config(toml))
    assert schedule.lr(0) == pytest.approx(0.01 * 3e-4)  # warmup starts at 0.01 x lr
    assert schedule.lr(schedule.num_steps - 1) < 0.02 * 3e-4  # and the decay ends near 0.01 x lr
    # One name with two suffixes is two datasets; the bare name is a third.
    assert sorted(config["data"]) == ["cfq", "cfq-sparql", "cfq-text"]
    assert [s["datasets"][0]["name"] for s in config["stages"]] == ["cfq-sparql", "cfq-text", "cfq"]
    assert config["training"]["evaluations"] == ["cfq"]
    assert config["logging"]["validation_interval"] == 0  # training/validation: false
    assert "architecture/dtype" in named and "training/skip_first_dataset_validation" in named


def test_wsd_reset_with_reset_optimizer_resets_at_every_boundary_and_restarts_the_lr(imported):
    toml, config, _, lines = imported(THESEUS / "benchmark_wsd_reset.yaml")
    text = toml.read_text()
    assert text.count("reset_optimizer = true") == 2 and "reset_restarts_lr = true" in text
    assert stage_indices(config, "reset_optimizer") == [1, 2]
    assert config["optimization"]["schedule"] == "wsd"
    assert any("reset_restarts_lr = true" in line for line in lines)
    loaded = load_config(toml)
    assert [s.reset_optimizer for s in loaded.stages] == [False, True, True]
    assert loaded.optimization.reset_restarts_lr is True


def test_wsd_reset_outside_the_benchmark_jobs_maps_the_same_way(imported):
    toml, config, _, lines = imported(THESEUS / "sweep_wsd_reset.yaml")
    assert toml.read_text().count("reset_optimizer = true") == 2
    assert stage_indices(config, "reset_optimizer") == [1, 2]
    assert config["optimization"]["reset_restarts_lr"] is True
    assert lines[0] == "rewind: import: lr schedule: wsd (optimization/schedule: wsd_reset)"


def test_wsd_reset_without_reset_optimizer_resets_nothing(imported, tmp_path):
    source = write_yaml(
        tmp_path,
        MINIMAL.replace("continual/train/abcd", "continual/train/benchmark")
        + "optimization: {schedule: wsd_reset}\n",
    )
    _, config, _, lines = imported(source)
    assert "reset_optimizer_stages" not in config["optimization"]
    assert stage_indices(config, "reset_optimizer") == []
    assert any("resets nothing in the original" in line for line in lines)


def test_cosine_rewarm_outside_the_benchmark_jobs_maps_to_rewinds_cosine_rewarm(imported):
    toml, config, named, lines = imported(THESEUS / "sweep_cosine_rewarm.yaml")
    text = toml.read_text()
    assert 'schedule = "cosine_rewarm"' in text and "rewarm_lr = 0.0002" in text
    opt = config["optimization"]
    assert (opt["min_lr_ratio"], opt["warmup_pct"]) == (0.05, 0.02)  # floor = the original's min_lr_mult
    assert "optimization/decay_pct" in named
    assert lines[0] == "rewind: import: lr schedule: cosine_rewarm (optimization/schedule: cosine_rewarm)"
    assert load_config(toml).optimization.rewarm_lr == 2e-4
    # Built-in names map to rewind's built-in datasets: no stubs.
    assert "data" not in config


def test_cosine_rewarm_defaults_are_the_originals(imported, tmp_path):
    source = write_yaml(
        tmp_path,
        MINIMAL.replace("continual/train/abcd", "continual/train/sweep")
        + "optimization: {schedule: cosine_rewarm}\n",
    )
    _, config, _, lines = imported(source)
    opt = config["optimization"]
    assert (opt["rewarm_lr"], opt["min_lr_ratio"], opt["warmup_pct"]) == (1e-4, 0.01, 0.01)
    assert any(
        line.startswith("rewind: import: absent keys written with the original's defaults") for line in lines
    )


def test_lora_and_model_family_have_no_counterpart(imported):
    _, config, named, _ = imported(THESEUS / "hybrid_lora.yaml")
    assert "LoRA" in named["optimization/lora"]
    assert "hybrid" in named["job"]
    assert "training/post_lora_tokens" in named and "training/post_lora_dataset" in named
    assert [s["tokens"] for s in config["stages"]] == [7_000_000_000, 140_000_000]  # the stages before LoRA only
    assert config["training"]["per_device_batch_size"] == 64


def test_kl_keys_a_job_does_not_read_are_named_not_imported(imported, tmp_path):
    source = write_yaml(
        tmp_path, MINIMAL + "optimization:\n  kl: {betas: [0.0, 0.5], reference_update_stages: [1]}\n"
    )
    _, config, named, _ = imported(source)
    assert "kl" not in config["optimization"] and not any("beta" in s for s in config["stages"])
    assert "without a KL penalty" in named["optimization/kl/betas"]
    assert "optimization/kl/reference_update_stages" in named


def test_stage_zero_refresh_and_early_beta_are_explained(imported, tmp_path):
    kl_job = MINIMAL.replace("continual/train/abcd", "continual/train/abcd_kl")
    _, config, _, lines = imported(
        write_yaml(
            tmp_path, kl_job + "optimization:\n  kl: {betas: [0.2, 0.5], reference_update_stages: [0]}\n"
        )
    )
    assert stage_indices(config, "refresh_reference") == [0]
    assert any("stage 0 never refreshes in the original" in line for line in lines)
    _, _, _, lines = imported(
        write_yaml(
            tmp_path,
            kl_job + "optimization:\n  kl: {betas: [0.2, 0.5], reference_update_stages: [1]}\n",
            "b.yaml",
        )
    )
    assert any("stages [0] have beta > 0 before any reference" in line for line in lines)


def test_per_device_batch_size_that_does_not_divide_becomes_minus_one(imported, tmp_path):
    source = write_yaml(
        tmp_path, MINIMAL.replace("batch_size: 8", "batch_size: 8\n  per_device_batch_size: 3")
    )
    _, config, _, lines = imported(source)
    assert config["training"]["per_device_batch_size"] == -1
    assert any("does not divide batch_size 8" in line for line in lines)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("job: [unclosed\n", "not valid YAML"),
        ("- a\n- b\n", "expected a YAML mapping"),
        ("", "expected a YAML mapping"),
        ("!!python/object/apply:os.getcwd []\n", "not valid YAML"),  # safe_load only: no objects
        (
            MINIMAL.replace("tokens: [8192, 4096]", "tokens: lots"),
            "training/tokens: expected a list of integers",
        ),
        (MINIMAL.replace("batch_size: 8", "batch_size: eight"), "training/batch_size: expected an integer"),
        (MINIMAL + "optimization: {lr: fast}\n", "optimization/lr: expected a number, got 'fast'"),
        (MINIMAL.replace("  - - {name: sort, rate: 1.0, style: PADDED}\n", ""), "training/dataset: 1 stages"),
        (MINIMAL.replace("rate: 1.0, style: PMD", "rate: 0, style: PMD"), "rate: expected a positive number"),
        (
            MINIMAL.replace("continual/train/abcd", "continual/train/sweep")
            + "optimization: {schedule: linear_rewarm}\n",
            "not a schedule the importer knows",
        ),
        (
            MINIMAL.replace("job: continual/train/abcd", "job: continual/train/abcd_kl")
            + "optimization:\n  kl: {betas: [0.1]}\n",
            "breaks rewind's rules: optimization.kl.betas",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(text, expected, rewind_cli, tmp_path):
    code, out, err = rewind_cli("import-config", write_yaml(tmp_path, text))
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and expected in err, err


def test_missing_file_directory_and_device_are_one_line(rewind_cli, tmp_path):
    cases = (
        (tmp_path / "nope.yaml", "no such config file"),
        (tmp_path, "is a directory"),
        ("/dev/zero", "not a regular file"),
    )
    for path, expected in cases:
        code, out, err = rewind_cli("import-config", path)
        assert (code, out) == (2, "") and err.count("\n") == 1 and expected in err


def test_an_unknown_key_inside_a_dataset_entry_is_named(imported, tmp_path):
    source = write_yaml(
        tmp_path, MINIMAL.replace("{name: sort, rate: 1.0,", "{name: sort, weight: 2, rate: 1.0,")
    )
    _, config, named, _ = imported(source)
    assert named["training/dataset[1][0]/weight"] == "unknown to the importer"
    assert config["stages"][1]["datasets"] == [{"name": "sort", "rate": 1.0}]
