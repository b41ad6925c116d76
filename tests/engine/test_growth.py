"""Growth on the live objects: what a StackAppended does to the model and optimizer, and the trunk cache.

The run used is examples/progressive.toml shrunk to 10 steps a stage (GROWN): stack 1 appended on a
frozen trunk (copied blocks, cached), stack 2 prepended as the identity on a LoRA trunk, stack 3
appended in NF4 with its own adapters on a QLoRA trunk, with dropout and two micro-batches a step.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from rewind.engine.data.userdata import DataHome
from rewind.engine.model import layout as layouts
from rewind.engine.run.growth import grow
from rewind.engine.run.parts import fresh_parts, open_datasets
from rewind.engine.step.step import train_step
from rewind.states.config_reading import loads_config
from rewind.states.events import ActivationsCached, StackAppended
from rewind.states.growth import grown_layout, growth_event, initial_layout
from rewind.stores import activations
from rewind.stores.trunks import checkpoint_weights
from tests.conftest import EXAMPLES
from tests.engine.test_loop import assert_bitwise_equal, events_of, run_cli

PROGRESSIVE = EXAMPLES / "progressive.toml"
GROWN = (
    "training.tokens=[2560,2560,2560,2560]",
    "architecture.d_model=32",
    "architecture.dropout=0.1",
    "training.per_device_batch_size=4",
    "logging.checkpoint_interval=4",
    "growth[1].position=prepend",
    "growth[2].precision=nf4",
)


def _fresh(config, run_dir):
    """Parts as a run of `config` starts with, its datasets read as bytes."""
    return fresh_parts(config, str(run_dir), open_datasets(config, DataHome()))


def grown_args(run_dir, *extra: str, overrides: tuple[str, ...] = GROWN) -> list[str]:
    sets = [part for override in overrides for part in ("--set", override)]
    return ["train", str(PROGRESSIVE), "--run-dir", str(run_dir), "--no-progress", *sets, *extra]


def final_tensors(run_dir) -> dict[str, torch.Tensor]:
    """Every tensor of the run's last checkpoint: base weights (frozen stacks' included), adapters,
    optimizer moments, each group's names prefixed."""
    from rewind.states.fold import fold
    from rewind.stores.checkpoints import CheckpointStore

    state = fold(events_of(run_dir))
    ref = state.last_checkpoint
    weights = checkpoint_weights(str(run_dir), ref.checkpoint, ref.files)
    optimizer = CheckpointStore(str(run_dir)).load(ref.checkpoint, ref.files, groups=["optimizer"])["optimizer"]
    return {
        **{f"model/{k}": v for k, v in weights["model"].items()},
        **{f"adapters/{k}": v for k, v in weights["adapters"].items()},
        **{f"optimizer/{k}": v for k, v in optimizer.items()},
    }


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("grown") / "straight"
    code, _, err = run_cli(*grown_args(run))
    assert code == 0, err
    return run


def _config(*growth: str):
    text = PROGRESSIVE.read_text().split("[[growth]]")[0]
    body = "\n".join(f"[[growth]]\nat_stage = 1\n{g}" for g in growth)
    return loads_config(text + body, overrides=["architecture.d_model=32"])


def _tokens(config, rows: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, config.architecture.vocab_size, (rows, config.architecture.block_size + 1), generator=generator)


def _logits(parts, tokens) -> torch.Tensor:
    with torch.no_grad():
        return layouts.eval_mode(parts.model)(tokens[:, :-1])


def _trained(parts, tokens, steps: int = 2):
    for k in range(steps):
        train_step(parts.model, parts.optimizer, tokens, torch.ones(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.bool),
                   config=parts.config, lr=1e-2, beta=0.0, reference=None, step=k)
    return parts


def _grown(parts, config):
    before = initial_layout(config.architecture.num_layers)  # the layout before the first growth
    event = growth_event(config, 0, before, 10, 2560)
    return grow(parts, before, grown_layout(before, event), event), event


@pytest.mark.parametrize("position", ["append", "prepend"])
@pytest.mark.parametrize("trunk", ["full", "frozen", "lora"])
def test_identity_growth_leaves_the_logits_unchanged(tmp_path, position, trunk):
    config = _config(f'init = "identity"\nposition = "{position}"\ntrunk = "{trunk}"\nnum_blocks = 2')
    tokens = _tokens(config)
    parts = _trained(_fresh(config, tmp_path), tokens)  # trained weights, not the seed's
    before = _logits(parts, tokens)
    grown, _ = _grown(parts, config)
    assert grown.model.num_blocks == config.architecture.num_layers + 2
    assert torch.equal(_logits(grown, tokens), before)


def test_a_prepended_stack_renames_nothing_and_moments_follow_their_parameters(tmp_path):
    config = _config('position = "prepend"\ntrunk = "full"')
    tokens = _tokens(config)
    parts = _trained(_fresh(config, tmp_path), tokens)
    old = {parts.param_names[p]: (p.detach().clone(), {k: v.clone() for k, v in parts.optimizer.state[p].items()})
           for p in parts.optimizer.state}
    grown, _ = _grown(parts, config)
    assert grown.model.order == [1, 0]
    new = {grown.param_names[p]: p for p in grown.model.parameters()}
    for name, (value, moments) in old.items():
        assert torch.equal(new[name], value), name
        carried = grown.optimizer.state[new[name]]
        assert carried.keys() == moments.keys()
        assert all(torch.equal(carried[k], moments[k]) for k in moments), name
    assert not any(n.startswith("stacks.1.") for n in old)  # the new stack starts without moments
    assert all(not grown.optimizer.state.get(p) for n, p in new.items() if n.startswith("stacks.1."))


def test_what_trains_after_each_trunk_choice(tmp_path):
    for trunk, expect in {
        "frozen": {"stacks.1", "head", "norm"},
        "lora": {"stacks.1", "head", "norm", "stacks.0:adapters"},
        "qlora": {"stacks.1", "head", "norm", "stacks.0:adapters"},
        "full": {"stacks.0", "stacks.1", "head", "norm", "embed"},
    }.items():
        config = _config(f'trunk = "{trunk}"')
        grown, _ = _grown(_fresh(config, tmp_path), config)
        training = set()
        for name, parameter in grown.model.named_parameters():
            if parameter.requires_grad:
                root = ".".join(name.split(".")[:2]) if name.startswith("stacks.") else name.split(".")[0]
                training.add(f"{root}:adapters" if layouts.is_adapter(name) else root)
        assert training == expect, trunk
        trainable = {p for p in grown.model.parameters() if p.requires_grad}
        in_optimizer = {p for group in grown.optimizer.param_groups for p in group["params"]}
        assert in_optimizer == trainable, trunk
        kinds = {type(m).__name__ for m in grown.model.stack(0).modules()}
        assert ("Linear4bit" in kinds) == (trunk == "qlora"), trunk


def test_adapters_are_initialised_from_the_run_not_from_the_global_rng(tmp_path):
    config = _config('trunk = "lora"')
    adapters = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        grown, _ = _grown(_fresh(config, tmp_path), config)
        adapters.append({n: p.detach().clone() for n, p in grown.model.named_parameters() if layouts.is_adapter(n)})
    assert adapters[0] and adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])
    assert any(float(v.abs().sum()) > 0 for n, v in adapters[0].items() if ".lora_A." in n)
    assert all(float(v.abs().sum()) == 0 for n, v in adapters[0].items() if ".lora_B." in n)


def test_the_run_grows_as_the_config_says(straight):
    events = events_of(straight)
    grown = [e for e in events if isinstance(e, StackAppended)]
    assert [(e.stack, e.position, e.init, e.trunk, e.precision) for e in grown] == [
        (1, "append", "copy", "frozen", "fp32"),
        (2, "prepend", "identity", "lora", "fp32"),
        (3, "append", "random", "qlora", "nf4"),
    ]
    cached = [e for e in events if isinstance(e, ActivationsCached)]
    assert [(e.version, e.step, e.num_steps, e.num_rows) for e in cached] == [(1, 10, 10, 80)]
    assert (straight / cached[0].path / "complete.json").exists()
    assert len(list((straight / "trunks").iterdir())) >= 3  # frozen stacks stored once each, not per checkpoint


def test_the_cache_changes_nothing_but_speed(straight, tmp_path):
    recomputed = tmp_path / "recomputed"
    code, _, err = run_cli(*grown_args(recomputed, overrides=(*GROWN, 'growth[0].cache="off"')))
    assert code == 0, err
    assert not any(isinstance(e, ActivationsCached) for e in events_of(recomputed))
    assert_bitwise_equal(final_tensors(straight), final_tensors(recomputed))


def test_a_cache_left_half_written_is_completed_on_resume(straight, tmp_path, monkeypatch):
    run = tmp_path / "half"
    written = []
    original = activations.ActivationCache.write_chunk

    class Killed(BaseException):
        """Not an Exception: nothing on the way catches it, as nothing catches a SIGKILL."""

    def dies_after_three(self, chunk, values):
        if len(written) == 3:
            raise Killed  # as a kill would: the chunks before are whole, the rest missing
        written.append(chunk)
        original(self, chunk, values)

    monkeypatch.setattr(activations.ActivationCache, "write_chunk", dies_after_three)
    with pytest.raises(Killed):
        run_cli(*grown_args(run))
    monkeypatch.setattr(activations.ActivationCache, "write_chunk", original)
    (path,) = (run / "cache").iterdir()  # trunk-<version>-<first step>-<config>.zarr
    assert path.name.startswith("trunk-1-00000010-")
    cache = activations.ActivationCache.open(str(path))
    # Chunks never written are missing (never read as zeros); written ones may be too, if the kill came
    # before their group of completion records was made durable (stores.activations).
    assert set(range(3, cache.num_chunks)) <= set(cache.missing_chunks())
    assert not any(isinstance(e, ActivationsCached) for e in events_of(run))
    code, _, err = run_cli(*grown_args(run))
    assert code == 0, err
    assert_bitwise_equal(final_tensors(straight), final_tensors(run))


def test_replay_and_fork_across_growth(straight, tmp_path):
    code, out, err = run_cli("replay", straight)
    assert code == 0, err
    assert "reproducible" in out
    child = tmp_path / "child"
    code, _, err = run_cli("fork", straight, child, "--at-step", "25", "--no-progress")
    assert code == 0, err
    assert_bitwise_equal(final_tensors(straight), final_tensors(child))
    layout = msgspec.to_builtins(events_of(child)[1].seed.layout)
    assert [s["stack"] for s in layout["stacks"]] == [2, 0, 1]  # the parent's grown model, by identity


VARIANTS = {
    "mlm": ['objective.kind="mlm"', "training.evaluations=[]", 'growth[0].cache="auto"'],
    "diffusion-input": ['objective.kind="diffusion"', 'objective.time="input"', "training.evaluations=[]", 'growth[0].cache="auto"'],
    "diffusion-depth": ['objective.kind="diffusion"', 'objective.time="depth"', "training.evaluations=[]", 'growth[0].cache="auto"'],
    "bf16-lora-then-qlora": ['growth[0].precision="bf16"'],  # its bf16 adapters widen when it is quantised
    "bf16-anchor": ['growth[0].precision="bf16"', 'growth[1].position="prepend"', "growth[1].anchor=true",
                    'growth[1].trunk="frozen"'],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_objectives_and_precisions_resume_bit_for_bit(tmp_path, variant):
    """Masked objectives (masks and levels from the run's streams), a bf16 stack and an anchored
    prepend, on stages of 5 steps: stopped every 6 steps and resumed, each ends with the straight run's
    tensors. The stops (steps 6, 12 and 18) fall inside each stage after a growth (at steps 5, 10 and
    15), the cache's stage included; longer stages and more stops would resume the same stages again."""
    overrides = (*GROWN, *VARIANTS[variant], "training.tokens=[1280,1280,1280,1280]")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    code, _, err = run_cli(*grown_args(straight, overrides=overrides))
    assert code == 0, err
    for _ in range(8):
        code, out, err = run_cli(*grown_args(stopped, "--max-steps", "6", overrides=overrides))
        assert code == 0, err
        if "finished" in out:
            break
    assert_bitwise_equal(final_tensors(straight), final_tensors(stopped))


def test_the_reference_shares_the_frozen_trunk_and_copies_what_trains(tmp_path):
    from rewind.engine.model.reference import reference_of

    config = _config('trunk = "qlora"')
    grown, _ = _grown(_fresh(config, tmp_path), config)
    reference = reference_of(grown.model, config, None, grown.trunk_sources)  # (layout: a sharded model's only)
    live = dict(grown.model.named_parameters())
    for name, parameter in reference.named_parameters():
        assert not parameter.requires_grad
        assert (parameter is live[name]) == (not live[name].requires_grad), name  # shared iff frozen
    assert any(type(p).__name__ == "Params4bit" and p is live[n] for n, p in reference.named_parameters())
    tokens = _tokens(config)
    with torch.no_grad():
        assert torch.equal(reference(tokens[:, :-1]), layouts.eval_mode(grown.model)(tokens[:, :-1]))


def test_verify_checks_the_frozen_stacks_files(straight, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(straight, run)
    code, out, err = run_cli("verify", run)
    assert code == 0, out + err
    victim = sorted((run / "trunks").iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out, err = run_cli("verify", run)
    assert code == 1
    assert "frozen stack" in out + err and "do not hash to its name" in out + err


def test_a_cache_is_never_taken_for_another_config_s(tmp_path):
    """Forked in place at the cache's first step with other data: the trunk's outputs are those of the
    new data, as in a run started with it (a cache is named by its trunk, first step and config)."""
    other = (*GROWN, 'training.datasets[1][0].name="sort"')
    forked, fresh = tmp_path / "forked", tmp_path / "fresh"
    code, _, err = run_cli(*grown_args(forked, "--max-steps", "10"))
    assert code == 0, err
    assert any(isinstance(e, ActivationsCached) for e in events_of(forked))  # written before the stop
    code, _, err = run_cli(*grown_args(forked, "--fork", overrides=other))
    assert code == 0, err
    code, _, err = run_cli(*grown_args(fresh, overrides=other))
    assert code == 0, err
    assert_bitwise_equal(final_tensors(fresh), final_tensors(forked))
    assert len(list((forked / "cache").iterdir())) == 1  # the old config's cache is gone


@pytest.mark.parametrize(
    "change",
    ['lora.targets=["attn.qkv"]', 'objective.kind="mlm"'],
)
def test_a_continuation_may_not_change_what_shapes_the_grown_model(tmp_path, change):
    run = tmp_path / "run"
    code, _, err = run_cli(*grown_args(run, "--max-steps", "25"))
    assert code == 0, err
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    overrides = (*GROWN, change, "training.evaluations=[]", 'growth[0].cache="auto"')
    code, _, err = run_cli(*grown_args(run, "--fork", overrides=overrides))
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1
    assert "cannot change" in err or "would change" in err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_replay_rebuilds_the_reference_for_a_changed_config(tmp_path):
    """A config change in place (here the RoPE base, which the reference computes with too) rebuilds the
    reference from its checkpoint under the new config, as the process that trained it did: replay
    reproduces the KL term after the change."""
    from tests.engine.test_loop import train_args

    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, "--max-steps", "15"))
    assert code == 0, err
    code, _, err = run_cli(*train_args(run, "--fork", "--set", "architecture.rope_base=500.0"))
    assert code == 0, err
    code, out, err = run_cli("replay", run)
    assert code == 0, out + err
    assert "reproducible" in out
