"""`rewind schedule`: the dry-run's outputs, its JSON contract and its handling of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rewind.states.check_schedule import schedule_warnings
from rewind.states.schedule import Schedule
from rewind.tools.configfile import load_config
from tests.conftest import EXAMPLES, REPO

TINY = EXAMPLES / "tiny.toml"
ABCD = EXAMPLES / "abcd.toml"


def test_timeline_lists_every_stage_and_the_summary(rewind_cli):
    code, out, err = rewind_cli("schedule", ABCD)
    assert code == 0, err
    for stage in range(4):
        assert f"StageEntered        stage {stage}" in out
    assert "ReferenceRefreshed  stage 1" in out
    assert "RunFinished" in out
    assert "  fade      into stage 1, cosine, overlap 0.4: tokens [" in out


@pytest.mark.parametrize(
    ("restarts", "says"), [("false", "the LR curve goes on unbroken"), ("true", "restarts its warmup")]
)
def test_an_optimizer_reset_is_shown_where_it_happens(rewind_cli, restarts, says):
    sets = [
        "--set",
        "optimization.reset_optimizer_stages=[2]",
        "--set",
        f"optimization.reset_restarts_lr={restarts}",
    ]
    code, out, err = rewind_cli("schedule", TINY, *sets)
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if "OptimizerReset" in line]
    entered = next(line for line in out.splitlines() if "StageEntered        stage 2" in line)
    assert line.split()[:2] == entered.split()[:2]  # at the step that enters stage 2
    assert "stage 2: AdamW moments cleared" in line and says in line


def test_json_transitions_have_type_step_tokens_and_fields(rewind_cli):
    code, out, _ = rewind_cli("schedule", ABCD, "--json")
    assert code == 0
    events = json.loads(out)["events"]
    assert events[0]["type"] == "StageEntered"
    assert events[-1]["type"] == "RunFinished"
    entered = [e for e in events if e["type"] == "StageEntered"]
    assert [e["stage"] for e in entered] == [0, 1, 2, 3]
    refresh = [e for e in events if e["type"] == "ReferenceRefreshed"]
    assert [e["stage"] for e in refresh] == [1]
    schedule = Schedule(load_config(ABCD))
    for e in events:
        assert e["tokens"] == e["step"] * schedule.tokens_per_step
    # A refresh comes right after the StageEntered of its stage, at the same step.
    i = next(i for i, e in enumerate(events) if e["type"] == "ReferenceRefreshed")
    assert events[i - 1]["type"] == "StageEntered" and events[i - 1]["step"] == events[i]["step"]


POSTTRAIN = EXAMPLES / "posttrain.toml"


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        (ABCD, ()),
        (TINY, ()),
        (TINY, ("--set", "training.fade.overlap=0", "--set", "optimization.schedule=wsds")),
        (POSTTRAIN, ()),
        (POSTTRAIN, ("--set", "stages[3].grpo.kl_beta=0", "--set", "stages[1].beta=0.1")),
        (POSTTRAIN, ("--set", "stages[1].beta=0.1")),
    ],
)
def test_json_carries_everything_the_text_view_shows(rewind_cli, config, overrides):
    code, text, err = rewind_cli("schedule", config, *overrides)
    assert code == 0, err
    code, out, err = rewind_cli("schedule", config, "--json", *overrides)
    assert code == 0, err
    view = json.loads(out)
    assert view["source"] == str(config)
    header = text.splitlines()[0]
    for key in ("num_stages", "num_steps", "tokens_per_step", "tokens", "budget"):
        assert f"{view[key]:,}" in header, key
    # Every stage's block of the text view, rebuilt from the JSON: a heading, then one line per field (a
    # strategy's settings may wrap).
    blocks = text.split("\n\nstage ")[1:]
    assert len(blocks) == len(view["stages"]) == view["num_stages"]
    for block, stage in zip(blocks, view["stages"], strict=True):
        heading, mixture, tie, *settings, entry, fade = block.split("\n\n")[0].splitlines()
        named = f" {stage['name']!r}" if stage["name"] else ""
        assert heading == (
            f"{stage['stage']}{named} ({stage['strategy']}): budget {stage['budget']:,} tokens, "
            f"trains {stage['trained_tokens']:,} in {stage['steps']:,} steps"
        )
        assert mixture.split() == ["mixture", *", ".join(f"{m['name']} {m['rate']:g}" for m in stage["mixture"]).split()]
        kl = stage["kl"]
        if stage["strategy"] in ("pretrain", "sft"):
            assert kl == {"setting": "beta", "value": stage["beta"], "penalty": stage["beta"]}
            assert tie.split() == ["beta", f"{stage['beta']:g}"]
        else:  # its token-level beta is 0 by rule: the line says the stage's own setting
            assert stage["beta"] == 0 and tie.split()[0] == "KL" and f"{kl['setting']} {kl['value']:g}" in tie
        if stage["settings"] is None:
            assert stage["strategy"] == "pretrain" and settings == []
        else:
            said = ", ".join(f"{key} {_toml(value)}" for key, value in stage["settings"].items())
            assert " ".join(settings).split() == [stage["strategy"], *said.split()]
        assert ("refreshes the KL reference" in entry) == stage["refresh_reference"]
        assert ("resets the optimizer" in entry) == stage["reset_optimizer"]
        assert (stage["fade"] is None) == (stage["stage"] == view["num_stages"] - 1) == ("(the last stage)" in fade)
    # Every fade window, in the block of the stage it fades out of; or the text's "none" when there is none.
    fade_lines = [line.strip() for line in text.splitlines() if line.startswith("  fade      into ")]
    assert fade_lines == [
        f"fade      into stage {f['boundary'] + 1}, {view['fade_curve']}, overlap {f['overlap']:g}: tokens "
        f"[{f['start_tokens']:,.0f}, {f['end_tokens']:,.0f}), steps {f['start_step']:,}..{f['end_step']:,}"
        for f in view["fades"]
    ]
    assert [s["fade"] for s in view["stages"] if s["fade"] and s["fade"]["end_tokens"] > s["fade"]["start_tokens"]] == view["fades"]
    assert ("fades: none" in text) == (not view["fades"])
    lr, kl = view["lr"], view["kl"]
    assert (
        f"lr: {lr['schedule']}, peak {lr['peak']:g}, first {lr['first']:.3g}, last {lr['last']:.3g}" in text
    )
    refresh = f"reference refreshed on entering {kl['reference_update_stages'] or 'never'}"
    assert kl["stages"] == [s["kl"] for s in view["stages"]]
    last = text.splitlines()[-1]
    if all(s["setting"] == "beta" for s in kl["stages"]):
        assert last == f"KL ({kl['kind']}): betas {kl['betas']}, {refresh}"
    else:  # a stage of its own tie to the reference: every stage's is said, not a list of betas
        # What the KL terms are: optimization.kl.kind where a beta adds one, a grpo stage's own estimator
        # where it adds one (the kind does not apply there).
        betas = any(s["setting"] == "beta" and s["penalty"] for s in kl["stages"])
        kinds = [f"beta: {kl['kind']}"] if betas else []
        grpo = [
            s["settings"]["kl_estimator"]
            for s in view["stages"]
            if s["kl"]["setting"] == "grpo.kl_beta" and s["kl"]["penalty"]
        ]
        kinds += [f"grpo.kl_estimator: {', '.join(dict.fromkeys(grpo))}"] if grpo else []
        said = "; ".join(kinds) or f"beta: {kl['kind']}"
        assert last.startswith(f"KL ({said}): ") and last.endswith(f"; {refresh}")
        for i, s in enumerate(kl["stages"]):
            assert f"stage {i} {s['setting']} {s['value']:g}" in last
    # And the events, one line each in the same order; a StageEntered names the stage's tie to the reference.
    event_lines = text.split("  event\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[2] for line in event_lines] == [e["type"] for e in view["events"]]
    entered = [line for line in event_lines if line.split()[2] == "StageEntered"]
    assert [line.rsplit(", ", 1)[1] for line in entered] == [f"{s['setting']} {s['value']:g}" for s in kl["stages"]]


def _toml(value) -> str:
    """A setting's value as the text view writes it: TOML's booleans, floats by :g, rewards by function."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ", ".join(f"{r['function']} x {r['weight']:g}" for r in value) + "]"
    return str(value)


def test_the_post_training_example_says_each_stages_tie_to_the_reference_and_its_settings(rewind_cli):
    """Not `betas [0.0, ...]` for stages whose beta must be 0: the dpo loss, grpo's kl_beta, and every
    setting of the strategy a stage trains with."""
    code, text, err = rewind_cli("schedule", POSTTRAIN)
    assert code == 0, err
    assert "StageEntered        stage 2 (sort 1), dpo.beta 0.1" in text
    assert "StageEntered        stage 3 (sort 1), grpo.kl_beta 0.02" in text
    assert "  KL        none added: the dpo loss compares the policy with the reference (dpo.beta 0.1)" in text
    assert "  KL        grpo.kl_beta 0.02 x the k3 estimate of the KL to the reference" in text
    assert "  sft       packing false\n" in text
    assert "  dpo       beta 0.1, loss sigmoid, label_smoothing 0, sft_weight 0\n" in text
    assert "  grpo      group_size 4, temperature 1, max_new_tokens 10, num_iterations 1," in text
    assert "kl_beta 0.02, kl_estimator k3," in text and "rewards [exact_match x 1]" in text
    assert "betas" not in text
    assert text.splitlines()[-1] == (
        "KL (grpo.kl_estimator: k3): stage 0 beta 0, stage 1 beta 0, stage 2 dpo.beta 0.1 (its loss; no KL "
        "penalty added), stage 3 grpo.kl_beta 0.02; reference refreshed on entering [2, 3]"
    )
    code, out, err = rewind_cli("schedule", POSTTRAIN, "--json")
    stages = json.loads(out)["stages"]
    assert [s["kl"] for s in stages] == [
        {"setting": "beta", "value": 0.0, "penalty": 0.0},
        {"setting": "beta", "value": 0.0, "penalty": 0.0},
        {"setting": "dpo.beta", "value": 0.1, "penalty": 0.0},
        {"setting": "grpo.kl_beta", "value": 0.02, "penalty": 0.02},
    ]
    assert stages[0]["settings"] is None and stages[1]["settings"] == {"packing": False}
    assert stages[3]["settings"]["group_size"] == 4 and stages[3]["settings"]["rewards"] == [
        {"function": "exact_match", "weight": 1.0}
    ]
    code, out, err = rewind_cli("schedule", POSTTRAIN, "--at", "300000")
    assert code == 0 and out.rstrip().endswith("stage 3 weights [0.000 0.000 0.000 1.000] rows [0, 0, 0, 32] lr 0.0003 grpo.kl_beta 0.02")


def test_at_describes_the_covering_step(rewind_cli):
    schedule = Schedule(load_config(ABCD))
    tps = schedule.tokens_per_step
    positions = [0, tps * 320 + 5, schedule.num_steps * tps - 1]
    code, out, _ = rewind_cli("schedule", ABCD, "--json", "--at", ",".join(map(str, positions)))
    assert code == 0
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [p // tps for p in positions]
    for r in rows:
        assert set(r) == {"tokens", "step", "stage", "weights", "rows", "lr", "beta", "kl"}
        assert r["kl"] == {"setting": "beta", "value": r["beta"], "penalty": r["beta"]}
        assert r["tokens"] == r["step"] * tps
        assert sum(r["rows"]) == 16
        assert abs(sum(r["weights"]) - 1) < 1e-12
    assert rows[0]["stage"] == 0 and rows[-1]["stage"] == 3
    assert rows[-1]["beta"] == 0.3


def test_at_outside_the_run_exits_2(rewind_cli):
    schedule = Schedule(load_config(TINY))
    end = schedule.num_steps * schedule.tokens_per_step
    for bad in (str(end), "-1"):
        code, _, err = rewind_cli("schedule", TINY, "--json", "--at", bad)
        assert code == 2
        assert "outside the run" in err and err.count("\n") == 1
    code, _, err = rewind_cli("schedule", TINY, "--at", "abc")
    assert code == 2 and "comma-separated" in err


def test_plot_is_written(rewind_cli, tmp_path):
    out_file = tmp_path / "sub" / "s.png"
    code, _, _ = rewind_cli("schedule", TINY, "--plot", out_file)
    assert code == 0
    assert out_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out_file.stat().st_size > 20_000  # a real figure, not an empty canvas


def test_plot_is_written_to_exactly_the_path_given_and_reported_so(rewind_cli, tmp_path):
    """Without a suffix matplotlib would add one (PATH.png) while the command reports PATH."""
    out_file = tmp_path / "schedule"
    code, _, err = rewind_cli("schedule", TINY, "--plot", out_file)
    assert code == 0, err
    assert out_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and list(tmp_path.iterdir()) == [out_file]
    assert err.splitlines()[-1] == f"plot written to {out_file}"
    code, _, err = rewind_cli("schedule", TINY, "--plot", tmp_path)  # a directory: refused before any work
    assert code == 2 and "is a directory" in err and err.count("\n") == 1


def schedule_texts(config, *overrides: str):
    """The schedule's figure, its readable text, and the labels of the weights panel."""
    from rewind.states.plan import plan
    from rewind.tools.plots import schedule_figure
    from rewind.tools.schedule_cmd import render_timeline

    schedule = Schedule(load_config(str(config), list(overrides)))
    events = list(plan(schedule))
    fig = schedule_figure(schedule, events)
    (weights,) = [ax for ax in fig.axes if ax.get_label() == "weights"]
    return fig, render_timeline(schedule, events, str(config)), weights


def test_the_plot_says_the_fades_as_the_text_does(rewind_cli):
    from rewind.tools.plots import pyplot

    fig, text, weights = schedule_texts(EXAMPLES / "progressive.toml")  # hard switches
    assert "fades: none (hard switches at the boundaries)" in text.splitlines()
    assert weights.get_title().endswith("; fades: none")
    pyplot().close(fig)
    fig, text, weights = schedule_texts(TINY, "training.fade.curve=cosine")
    assert any(line.startswith("  fade      into stage 1, cosine, overlap 0.5: ") for line in text.splitlines())
    assert weights.get_title().endswith("; fades: cosine, overlap 0.5")
    pyplot().close(fig)


def test_growth_labels_and_stage_labels_do_not_cover_each_other():
    """progressive.toml: a stack joins as each stage begins, so both labels stand at the same boundary."""
    from rewind.tools.plots import pyplot

    fig, _, weights = schedule_texts(EXAMPLES / "progressive.toml")
    renderer = fig.canvas.get_renderer()
    stages = [t.get_window_extent(renderer) for t in weights.texts if t.get_gid() == "stage label"]
    growths = [t.get_window_extent(renderer) for t in weights.texts if t.get_text().startswith("+stack")]
    assert len(stages) == 4 and len(growths) == 3
    assert not any(s.overlaps(g) for s in stages for g in growths)
    pyplot().close(fig)


# Stage 1 of tiny.toml has KL weight 0.2; with no reference until stage 2 and fades over whole stages,
# the check has two warnings about it.
SUSPICIOUS = ("--set", "training.fade.overlap=1.0", "--set", "optimization.kl.reference_update_stages=[2]")


def test_check_prints_one_line_per_warning_instead_of_the_timeline_and_exits_0(rewind_cli):
    code, out, err = rewind_cli("schedule", TINY, "--check", *SUSPICIOUS)
    assert code == 0, err
    assert out.splitlines() == [
        "warning: stage 1: KL weight 0.2 > 0 but no reference refresh happens at or before it "
        "(stages refreshing the reference: [2])",
        "warning: stage 1: 12800 of its 12800 tokens (100%) lie inside the fades of boundaries [0, 1], "
        "more than 75%",
        "2 warning(s)",
    ]
    code, out, _ = rewind_cli("schedule", ABCD, "--check")
    assert (code, out) == (0, "no warnings\n")


def test_check_json_is_the_warnings_of_the_config(rewind_cli):
    code, out, _ = rewind_cli("schedule", TINY, "--check", "--json", *SUSPICIOUS)
    assert code == 0
    config = load_config(TINY, ["training.fade.overlap=1.0", "optimization.kl.reference_update_stages=[2]"])
    assert json.loads(out) == {"warnings": schedule_warnings(config)}
    assert len(json.loads(out)["warnings"]) == 2
    code, out, _ = rewind_cli("schedule", ABCD, "--check", "--json")
    assert (code, json.loads(out)) == (0, {"warnings": []})


CONSTANT = """
[architecture]
block_size = 16

[training]
batch_size = 4

[optimization]
schedule = "constant"
{warmup}
[[stages]]
tokens = 640
datasets = [{{ name = "grammar" }}]
"""


@pytest.mark.parametrize(
    ("warmup", "overrides", "warned"),
    [
        ("", (), None),  # the default warmup_pct (0.01), never written: nothing to warn about
        ("warmup_pct = 0.01", (), "0.01"),  # written, even at the default's value
        ("warmup_pct = 0.05", (), "0.05"),
        ("", ("--set", "optimization.warmup_pct=0.2"), "0.2"),  # written by --set
        ("warmup_pct = 0.0", (), None),  # no warmup asked for
    ],
)
def test_check_warns_of_a_warmup_the_constant_schedule_ignores_only_where_the_config_wrote_one(
    rewind_cli, tmp_path, warmup, overrides, warned
):
    path = tmp_path / "constant.toml"
    path.write_text(CONSTANT.format(warmup=warmup))
    code, out, err = rewind_cli("schedule", path, "--check", *overrides)
    assert code == 0, err
    said = [line for line in out.splitlines() if "warmup_pct" in line]
    if warned is None:
        assert said == [] and out == "no warnings\n"
    else:
        assert said == [
            f"warning: optimization.warmup_pct: {warned} is ignored by the constant schedule (every step trains "
            'at lr); for a warmup to a constant LR, use schedule = "wsd" with decay_pct = 0'
        ]


def test_the_post_training_example_has_no_warning(rewind_cli):
    code, out, err = rewind_cli("schedule", POSTTRAIN, "--check")
    assert (code, out) == (0, "no warnings\n"), err


def test_check_help_says_what_warnings_do_to_the_exit_status(rewind_cli):
    code, out, _ = rewind_cli("schedule", "--help")
    assert code == 0
    check_help = " ".join(out.split("--check", 1)[1].split())
    assert "the exit status is 0 with or without them (2 for a bad config)" in check_help
    code, _, err = rewind_cli("schedule", TINY, "--check", "--set", "training.fade.overlap=7")
    assert code == 2 and "training.fade.overlap" in err


def test_bad_config_reports_every_problem_with_exit_2(rewind_cli, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        "[training]\ntokens = [100, -5]\ndatasets = [[{name='grammar'}], [{name='nope'}]]\n"
        "[training.fade]\noverlap = 1.5\ncurve = 'zigzag'\nper_boundary_overlap = [0.1, 0.2]\n"
        "[optimization.kl]\nreference_update_stages = [4]\n"
    )
    code, out, err = rewind_cli("schedule", bad)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    for needle in (
        "training.tokens[1]",
        "training.datasets[1][0].name",
        "training.fade.overlap",
        "training.fade.curve",
        "training.fade.per_boundary_overlap: expected 1 entries",
        "optimization.kl.reference_update_stages[0]",
    ):
        assert sum(needle in line for line in lines) == 1, (needle, lines)
    assert "Traceback" not in err


def test_missing_and_non_toml_files_exit_2_with_one_line(rewind_cli, tmp_path):
    code, _, err = rewind_cli("schedule", tmp_path / "nope.toml")
    assert code == 2 and "no such config file" in err and err.count("\n") == 1
    junk = tmp_path / "junk.toml"
    junk.write_text("this is = = not toml")
    code, _, err = rewind_cli("schedule", junk)
    assert code == 2 and "not valid TOML" in err and err.count("\n") == 1


def test_set_overrides_a_field(rewind_cli):
    code, out, _ = rewind_cli("schedule", TINY, "--json", "--set", "training.fade.overlap=0")
    assert code == 0
    assert not [e for e in json.loads(out)["events"] if e["type"].startswith("Fade")]
    code, _, err = rewind_cli("schedule", TINY, "--set", "training.fade.overlap=7")
    assert code == 2 and "training.fade.overlap" in err


def test_schedule_runs_without_importing_torch():
    probe = (
        "import sys; from rewind.tools.cli import main; "
        f"rc = main(['schedule', {str(TINY)!r}, '--json']); "
        "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.strip().splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[1] in (REPO / ".ci" / "run").read_text()
