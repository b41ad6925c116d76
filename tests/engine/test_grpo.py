"""A grpo stage's update: the first update of a rollout batch sees a ratio of exactly 1 (the old
log-probs come through the path the update computes on, kept in the file and laid back on the rows bit
for bit), so even a clip band of zero width holds nothing; the second update of the batch (after an
optimizer step) is clipped; the rollout batch's rows and values move between the file's coordinates and
the training rows exactly. (Killed and resumed inside a window: test_posttrain_kill.)"""

from __future__ import annotations

import copy
import dataclasses

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rewind.engine.data.example_batches import completion_batch
from rewind.engine.model.layout import build_model
from rewind.engine.posttrain import rollouts
from rewind.engine.posttrain.generation import sample_completions
from rewind.engine.posttrain.grpo_step import WindowRows, grpo_train_step
from rewind.engine.posttrain.rolloutreader import TrainingRows, off_rows, on_rows, training_rows
from rewind.engine.posttrain.rollouts import logprobs_of
from rewind.engine.step.step import build_optimizer
from rewind.states.config_reading import loads_config
from rewind.states.events import RolloutsRecorded
from rewind.stores.rollouts import read_rollouts
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES
from tests.engine.test_loop import run_cli
from tests.engine.test_rewards import grpo_config

TINY = (EXAMPLES / "tiny.toml").read_text()
THIRD = 'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\nbeta = 0.2'
SETTINGS = "grpo = { group_size = 4, max_new_tokens = 8, epsilon_low = 0.0, epsilon_high = 0.0 }"
TEXT = (
    TINY.replace(THIRD, f'strategy = "grpo"\ndatasets = [{{ name = "sort", rate = 1.0 }}]\n{SETTINGS}')
    .replace("[training.fade]\noverlap = 0.5", "[training.fade]\noverlap = 0.0")
    .replace("[architecture]", "[architecture]\ndropout = 0.1")  # off in grpo updates
)
WHOLE = loads_config(TEXT)
CONFIG = loads_config(TEXT.replace("[training]", "[training]\nper_device_batch_size = 2"))  # 4 micro-batches
NEWLINE = 10


def _rows(model, seed: int = 0) -> TrainingRows:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(11, 120, (int(n),), generator=generator).tolist() for n in (5, 9)]
    completions = []
    for n in range(8):
        length = 1 + n % 8
        tokens = torch.randint(11, 120, (length,), generator=generator).tolist()
        completions.append(tokens + ([NEWLINE] if n % 3 else []))  # some finished, some cut
    batch = completion_batch([prompts[i // 4] for i in range(8)], completions, NEWLINE, 0, 32)
    old = logprobs_of(model, batch.tokens, batch.completion_mask, CONFIG, 1.0)
    advantages = torch.randn(8, generator=generator)
    return TrainingRows(batch.tokens, batch.completion_mask, old, None, advantages, torch.zeros(1, 8))


def test_the_first_update_of_a_rollout_batch_sees_a_ratio_of_exactly_one_and_the_second_is_clipped():
    model = build_model(CONFIG, None)
    rows = _rows(model)
    optimizer = build_optimizer(model, CONFIG)
    first = grpo_train_step(model, optimizer, rows, config=CONFIG, stage=CONFIG.stages[2], lr=0.05)
    # a band of zero width: any ratio other than exactly 1 would be counted as clipped
    assert first.metrics["clipped_low"] == 0.0 and first.metrics["clipped_high"] == 0.0
    assert first.finite and first.grad_norm > 0
    second = grpo_train_step(model, optimizer, rows, config=CONFIG, stage=CONFIG.stages[2], lr=0.05)
    assert second.metrics["clipped_low"] + second.metrics["clipped_high"] > 0


def test_an_update_is_the_same_in_one_micro_batch_or_several():
    model = build_model(CONFIG, None)
    rows = _rows(model, seed=3)
    results = []
    for config in (WHOLE, CONFIG):
        copied = copy.deepcopy(model)
        optimizer = build_optimizer(copied, config)
        results.append(grpo_train_step(copied, optimizer, rows, config=config, stage=config.stages[2], lr=0.0))
    a, b = results
    assert abs(a.loss - b.loss) <= 1e-6 * max(abs(a.loss), 1e-6) and abs(a.grad_norm - b.grad_norm) <= 1e-5 * a.grad_norm


@given(st.lists(st.integers(0, 8), min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_values_move_between_the_file_and_the_rows_exactly(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    completions = [torch.randint(11, 120, (n,), generator=generator).tolist() for n in lengths]
    batch = completion_batch([[1, 2, 3]] * len(lengths), completions, NEWLINE, 0, 16)
    values = torch.randn(len(lengths), 8, generator=generator)
    within = torch.arange(8).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    values = values * within  # the file's padding is 0
    laid = on_rows(values, torch.tensor(lengths), batch.completion_mask)
    assert torch.equal(off_rows(laid, batch.completion_mask, 8), values)


def test_a_rollout_batch_s_rows_are_its_prompts_and_completions():
    tensors = {
        "prompts": torch.tensor([[5, 6, 0], [7, 8, 9]]),
        "prompt_lengths": torch.tensor([2, 3]),
        "completions": torch.tensor([[1, NEWLINE], [2, 0], [3, 3], [4, NEWLINE]]),
        "completion_lengths": torch.tensor([2, 1, 2, 2]),
        "old_logprobs": torch.tensor([[-1.0, -2.0], [-3.0, 0.0], [-4.0, -5.0], [-6.0, -7.0]]),
        "advantages": torch.zeros(4),
        "rewards": torch.zeros(1, 4),
    }
    rows = training_rows(tensors, end_id=NEWLINE, pad_id=0, block_size=8, drop_truncated=True)
    assert rows.tokens[0, :4].tolist() == [5, 6, 1, NEWLINE] and rows.tokens[3, :5].tolist() == [7, 8, 9, 4, NEWLINE]
    # rows 1 and 2 have no end token: dropped from the loss, their values with them
    assert rows.mask.sum(dim=1).tolist() == [2, 0, 0, 2]
    assert rows.old_logprobs[0][rows.mask[0]].tolist() == [-1.0, -2.0] and rows.old_logprobs[1].abs().sum() == 0


@pytest.mark.parametrize("as_rows", [TrainingRows, WindowRows])
def test_a_step_logs_the_mean_reward_of_its_scored_completions_and_the_kl_its_loss_uses(as_rows):
    """metrics["reward"]: over the completions some function scored, the others counted in "unscored";
    kl: sum(ratio * k3) / tokens, the loss's importance-weighted estimate (the plain mean of k3 on a
    window's first update only, where the ratio is exactly 1). A window of a run started today, or rows
    built elsewhere."""
    model = build_model(CONFIG, None)
    rows = _rows(model, seed=5)
    rows = as_rows(**{field.name: getattr(rows, field.name) for field in dataclasses.fields(rows)})
    rows = with_reference_and_unscored(rows)
    grpo = msgspec.structs.replace(CONFIG.stages[2].grpo, kl_beta=0.1, epsilon_low=0.2, epsilon_high=0.2)
    stage = msgspec.structs.replace(CONFIG.stages[2], grpo=grpo)
    optimizer = build_optimizer(model, CONFIG)
    mask = rows.mask
    for update in range(2):
        policy = logprobs_of(model, rows.tokens, mask, CONFIG, 1.0)[mask].double()  # as the update computes them
        result = grpo_train_step(model, optimizer, rows, config=CONFIG, stage=stage, lr=0.05)
        ratio = torch.exp(policy - rows.old_logprobs[mask].double())
        d = policy - rows.reference_logprobs[mask].double()
        k3 = torch.exp(-d) - 1 + d
        weighted, plain = float((ratio * k3).sum() / mask.sum()), float(k3.mean())
        assert result.kl == pytest.approx(weighted, rel=1e-5) and result.metrics["kl"] == result.kl
        if update == 0:
            assert torch.equal(ratio, torch.ones_like(ratio))
        else:  # the weighting matters here: the plain mean is not what is logged
            assert abs(weighted - plain) > 1e-3 * plain
        assert result.metrics["reward"] == 0.75 and result.metrics["unscored"] == 4.0  # not 3 / 8


def with_reference_and_unscored(rows):
    """`rows` with reference log-probs a little off the old ones (so k3 is not 0) and half the
    completions unscored (NaN rewards): what the figures' tests weigh."""
    noise = 0.3 * torch.randn(rows.mask.shape, generator=torch.Generator().manual_seed(9))
    nan = float("nan")
    return dataclasses.replace(
        rows,
        reference_logprobs=(rows.old_logprobs + noise).masked_fill(~rows.mask, 0.0),
        rewards=torch.tensor([[1.0, nan, 0.0, nan, 1.0, 1.0, nan, nan]]),
    )


def test_a_run_started_before_scored_figures_logs_the_figures_it_always_had():
    """Without the feature scored_reward_figures (rewind.states.features), a window's steps log the mean
    reward with the unscored completions counted as 0, no "unscored", and the plain mean of k3 as the KL
    (also what the update's finiteness check reads), and update the weights as a run with it does: the
    figures are all that differs."""
    model = build_model(CONFIG, None)
    rows = _rows(model, seed=5)
    rows = with_reference_and_unscored(rows)
    held = {field.name: getattr(rows, field.name) for field in dataclasses.fields(rows)}
    old, new = WindowRows(**held, scored_figures=False), WindowRows(**held)
    grpo = msgspec.structs.replace(CONFIG.stages[2].grpo, kl_beta=0.1, epsilon_low=0.2, epsilon_high=0.2)
    stage = msgspec.structs.replace(CONFIG.stages[2], grpo=grpo)
    models = [build_model(CONFIG, None) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [build_optimizer(m, CONFIG) for m in models]
    mask = rows.mask
    for update in range(2):
        policy = logprobs_of(models[0], rows.tokens, mask, CONFIG, 1.0)[mask].double()
        result = grpo_train_step(models[0], optimizers[0], old, config=CONFIG, stage=stage, lr=0.05)
        today = grpo_train_step(models[1], optimizers[1], new, config=CONFIG, stage=stage, lr=0.05)
        d = policy - rows.reference_logprobs[mask].double()
        plain = float((torch.exp(-d) - 1 + d).mean())
        assert result.kl == pytest.approx(plain, rel=1e-5) and result.metrics["kl"] == result.kl
        assert update == 0 or abs(result.kl - today.kl) > 1e-3 * plain  # the second update's figures differ
        assert result.metrics["reward"] == pytest.approx(3 / 8) and "unscored" not in result.metrics
        assert list(result.metrics) == ["reward", "kl", "clipped_low", "clipped_high", "completion_tokens"]
        assert result.loss == today.loss and result.grad_norm == today.grad_norm
    after = [m.state_dict() for m in models]
    assert all(torch.equal(after[0][name], after[1][name]) for name in after[0])


def test_with_mask_truncated_completions_the_file_holds_zero_log_probs_for_the_cut_ones(tmp_path, monkeypatch):
    """docs/posttraining.md: a truncated completion trains on nothing, and its old and reference
    log-probs in the rollout file are 0 (not computed); a finished one's are not. (A model this young
    never ends a completion: every other one is ended by hand after its first token.)"""

    def some_end(*args, **kwargs):
        drawn = sample_completions(*args, **kwargs)
        return [
            dataclasses.replace(c, tokens=[c.tokens[0], NEWLINE], finish_reason="eos", log_probs=[*c.log_probs[:1], -1.0])
            if n % 2 and c.finish_reason == "length" else c
            for n, c in enumerate(drawn)
        ]  # fmt: skip

    monkeypatch.setattr(rollouts, "sample_completions", some_end)
    stage = (
        '\n[[stages]]\nstrategy = "grpo"\ntokens = 4_096\ndatasets = [{ name = "reverse", rate = 1.0 }]\n'
        "refresh_reference = true\n"
        "grpo = { group_size = 4, max_new_tokens = 3, kl_beta = 0.1, mask_truncated_completions = true }\n"
    )
    (tmp_path / "post.toml").write_text(grpo_config("", stage))
    run = tmp_path / "run"
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", run, "--no-progress", "--max-steps", "4")
    assert code == 0, err
    records = [e for _, e in read_seq_events(run) if isinstance(e, RolloutsRecorded)]
    finished = cut = 0
    for record in records:
        tensors, _ = read_rollouts(str(run), record.path, record.sha256)
        for n, done in enumerate(tensors["finished"].tolist()):
            held = [tensors[name][n, : tensors["completion_lengths"][n]] for name in ("old_logprobs", "reference_logprobs")]
            if done:
                finished += 1
                assert all(bool((values < 0).all()) for values in held)
            else:
                cut += 1
                assert all(bool((values == 0).all()) for values in held)
    assert finished and cut  # both kinds were sampled
