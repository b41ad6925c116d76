"""`rewind sample` on a tiny run trained through the CLI: the model of the checkpoint asked for (the last
one is grown, its trunk NF4 with LoRA adapters), the run's tokenizer, a draw decided by the seed, and
every mistake as one line. `trained_run` is shared with test_eval_cmd.py: one run per test session."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rewind.engine.data.tokenizer import ByteTokenizer, train_bpe
from rewind.engine.posttrain.sampling import generate
from rewind.states.config_reading import config_from_dict
from rewind.states.entry import EntryRefused, choose_live_point
from rewind.states.events import CheckpointCommitted
from rewind.stores.runs import read_seq_events
from rewind.tools.cli import main
from rewind.tools.errors import UsageError
from rewind.tools.sample_cmd import model_at, refuse_masked
from tests.tools.small_posttrain import train_small_posttrain

# Stage 0 (3 steps of 96 tokens) on grammar, stage 1 (2 steps) on add, growing at its entry: the trunk
# becomes NF4 with LoRA adapters and a new stack trains on top. Checkpoints: the boundary (step 3,
# one stack) and the end (step 5, grown); retention deletes the interval one at step 4.
CONFIG = """
[run]
seed = 3
[architecture]
block_size = 24
vocab_size = 256
num_layers = 1
num_heads = 2
d_model = 32
[training]
batch_size = 4
tokens = [288, 192]
datasets = [[{ name = "grammar" }], [{ name = "add" }]]
evaluations = ["grammar", "add"]
eval_samples = 8
[logging]
checkpoint_interval = 4
keep_last_checkpoints = 1
[[growth]]
at_stage = 1
num_blocks = 1
trunk = "qlora"
"""
PROMPT = "add 12+34="
_TRAINED: dict[str, Path] = {}


def trained_run(tmp_path_factory) -> Path:
    """The run, trained once per session by `rewind train` in a subprocess (one CPU thread, recorded in
    its log, so that in-process commands of these tests compute what the run computed)."""
    if "run" not in _TRAINED:
        base = tmp_path_factory.mktemp("sampled")
        (base / "config.toml").write_text(CONFIG)
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"} | {"OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "rewind.tools.cli", "train", "config.toml", "--run-dir", "run", "--no-progress"]
        done = subprocess.run(command, cwd=base, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        _TRAINED["run"] = base / "run"
    return _TRAINED["run"]


def cli(*args: str) -> tuple[int, str, str]:
    """`rewind ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def one_line_error(code: int, out: str, err: str, exit_code: int) -> str:
    assert code == exit_code and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rewind"), err
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory)


def committed(run: Path) -> dict[int, str]:
    return {e.step: e.checkpoint for _, e in read_seq_events(str(run)) if isinstance(e, CheckpointCommitted)}


def test_greedy_continues_with_the_last_checkpoints_argmax_chain(run):
    code, out, err = cli("sample", run, "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "20", "--json")
    assert code == 0, err
    result = json.loads(out)
    loaded = model_at(str(run), None)
    assert loaded.model.stack_sizes == [1, 1]  # grown
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert "Linear4bit" in kinds and any(".lora_A." in n for n, _ in loaded.model.named_parameters())
    prompt_ids = list(PROMPT.encode())
    want = generate(loaded.model, prompt_ids, max_new_tokens=20, temperature=0.0, top_p=1.0, seed=0)
    assert result["tokens"] == want and len(want) == 20
    assert result["completion"] == ByteTokenizer().decode(want)
    assert result["prompt"] == PROMPT and result["prompt_tokens"] == prompt_ids
    assert (result["step"], result["checkpoint"]) == (5, committed(run)[5])
    assert result["stopped"] == "max_tokens" and result["seed"] == 0
    # Without --json: the continuation itself.
    code, out, _ = cli("sample", run, "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "20")
    assert code == 0 and out == result["completion"] + "\n"


def test_at_step_loads_that_checkpoint_and_names_the_steps_there_are(run):
    code, out, err = cli("sample", run, "--at-step", "3", "--prompt", PROMPT, "--max-tokens", "5", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["step"], result["checkpoint"]) == (3, committed(run)[3])
    assert model_at(str(run), 3).model.stack_sizes == [1]  # before the growth
    line = one_line_error(*cli("sample", run, "--at-step", "4", "--prompt", PROMPT), exit_code=2)
    assert "--at-step 4: no checkpoint at that step" in line and "steps 3, 5" in line


def test_the_seed_decides_the_draw(run):
    def draw(seed: int) -> list[int]:
        code, out, err = cli("sample", run, "--prompt", PROMPT, "--seed", seed, "--top-p", "0.95", "--json")
        assert code == 0, err
        return json.loads(out)["tokens"]

    first = draw(1)
    assert len(first) == 24 and draw(1) == first  # by default 64 tokens, or the context (24) if shorter
    assert draw(2) != first


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "an empty prompt"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
        (["--prompt", "x", "--temperature", "nan"], "--temperature nan"),
        (["--prompt", "x", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (["--prompt", "x", "--max-tokens", "-1"], "--max-tokens -1: must be >= 0"),
        ([], "the following arguments are required: --prompt"),
    ],
)
def test_bad_requests_are_one_line_and_exit_2(run, args, message):
    assert message in one_line_error(*cli("sample", run, *args), exit_code=2)


def test_more_new_tokens_than_the_models_context_are_refused_in_one_line(run, monkeypatch):
    from rewind.engine.model.model import GPT

    forward, calls = GPT.forward, []

    def counted(self, *args, **kwargs):  # (before the bound, this request ran for days)
        calls.append(1)
        assert len(calls) <= 24, "generation ran past the model's context"
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", counted)
    line = one_line_error(*cli("sample", run, "--prompt", PROMPT, "--max-tokens", "1000000000"), exit_code=2)
    assert calls == []
    assert "--max-tokens 1000000000: at most the model's context, 24 tokens (architecture.block_size)" in line
    code, out, err = cli("sample", run, "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0", "--json")
    assert code == 0 and len(json.loads(out)["tokens"]) == 24 == json.loads(out)["max_tokens"], err


@pytest.mark.parametrize("setting", [["--top-p", "1e-300"], ["--temperature", "1e-300"]])
def test_settings_below_float32s_range_draw_the_most_likely_token(run, setting):
    """Both once reached torch.multinomial with NaN probabilities (a traceback): each is greedy now."""
    args = ["sample", run, "--prompt", PROMPT, "--max-tokens", "8", "--json"]
    code, out, err = cli(*args, *setting)
    assert code == 0 and "Traceback" not in err, err
    assert json.loads(out)["tokens"] == json.loads(cli(*args, "--temperature", "0")[1])["tokens"]


def test_a_model_whose_logits_are_not_finite_is_one_line_and_exit_1(run, tmp_path, monkeypatch):
    import torch

    from rewind.engine.model.model import GPT

    forward = GPT.forward
    monkeypatch.setattr(GPT, "forward", lambda self, *a, **k: forward(self, *a, **k) * torch.nan)
    line = one_line_error(*cli("sample", run, "--prompt", PROMPT), exit_code=1)
    assert "the model's logits at position 10 are not finite" in line and committed(run)[5] in line


def test_a_missing_run_or_missing_checkpoint_files_are_one_line(run, tmp_path):
    line = one_line_error(*cli("sample", tmp_path / "nowhere", "--prompt", "x"), exit_code=2)
    assert "no run here" in line
    shutil.copytree(run / "events", tmp_path / "bare" / "events")  # the log, without its checkpoints
    line = one_line_error(*cli("sample", tmp_path / "bare", "--prompt", "x"), exit_code=1)
    assert committed(run)[5] in line


def test_a_tokenizer_that_is_not_the_runs_is_refused(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "data").mkdir(exist_ok=True)
    (copy / "data" / "tokenizer.json").write_text(train_bpe(["add 1+2=3\n"] * 8, 260).to_json())
    line = one_line_error(*cli("sample", copy, "--prompt", PROMPT), exit_code=1)
    assert "not the one it was trained with" in line and "the log records bytes" in line


def test_no_checkpoint_and_masked_objectives_are_refused():
    with pytest.raises(EntryRefused, match="no committed checkpoint yet") as raised:
        choose_live_point("RUN", [], None)
    assert raised.value.exit_code == 1
    training = {"tokens": [96], "datasets": [[{"name": "grammar"}]]}
    masked = config_from_dict({"objective": {"kind": "mlm"}, "training": training})
    with pytest.raises(UsageError, match=r"masked objective \(mlm\).*cannot sample"):
        refuse_masked(masked, "sample")


@pytest.fixture(scope="module")
def posttrained(tmp_path_factory) -> Path:
    """The small post-training example (UTF-8 bytes: no <|endoftext|>): a checkpoint at step 2 (the end
    of pretraining) and one at step 14 (after sft, dpo and grpo)."""
    run = tmp_path_factory.mktemp("posttrained") / "run"
    return train_small_posttrain(run, "--set", "logging.keep_last_checkpoints=10")


def newline_draw(run: Path, at_step: int, prompt: bytes) -> tuple[int, list[int]]:
    """A seed whose draw (temperature 1, not stopped) of the checkpoint at `at_step` holds a newline, and
    that draw."""
    loaded = model_at(str(run), at_step)
    for seed in range(100):
        tokens = generate(loaded.model, list(prompt), max_new_tokens=20, temperature=1.0, top_p=1.0, seed=seed)
        if 10 in tokens:
            return seed, tokens
    raise AssertionError("no draw with a newline in 100 seeds")


def draw(run: Path, at_step: int, seed: int, *more: str) -> dict:
    args = ("--prompt", "sort dcba=", "--max-tokens", "20", "--seed", seed, "--at-step", at_step, "--json", *more)
    code, out, err = cli("sample", run, *args)
    assert code == 0, err
    return json.loads(out)


def test_a_post_trained_byte_model_stops_at_the_newline_that_ends_a_response(posttrained):
    """docs/posttraining.md: without <|endoftext|> a response is one line, "\\n" its end token: the text
    stops before it (as it stops before <|endoftext|>), unless --no-stop."""
    seed, tokens = newline_draw(posttrained, 14, b"sort dcba=")
    stopped = draw(posttrained, 14, seed)
    assert stopped["end_token"] == 10 and stopped["stopped"] == "eos"
    assert stopped["tokens"] == tokens[: tokens.index(10)] and "\n" not in stopped["completion"]
    whole = draw(posttrained, 14, seed, "--no-stop")
    assert whole["end_token"] is None and whole["tokens"] == tokens and whole["stopped"] == "max_tokens"


def test_a_pretrained_byte_model_does_not_stop_at_a_newline(posttrained):
    """The checkpoint at the end of pretraining (the same run; no post-training stage yet): its newlines
    are text."""
    seed, tokens = newline_draw(posttrained, 2, b"sort dcba=")
    drawn = draw(posttrained, 2, seed)
    assert drawn["end_token"] is None and drawn["tokens"] == tokens and "\n" in drawn["completion"]


def test_help_says_where_a_sample_stops():
    code, out, _ = cli("sample", "--help")
    assert code == 0
    said = " ".join(out.split("--no-stop", 1)[1].split())
    assert "<|endoftext|>" in said and "sft, dpo or grpo" in said and 'the "\\n" that ends each response' in said
