"""docs/sampling.md's recipe draws rewind's tokens: implemented here from the page's words (hashlib and
plain torch; only the model's forward is rewind's), it re-draws what the batched sampler drew, on a tiny
model for several keys and on a trained run's rollout batch from its record, file and checkpoint; and the
page's own Python block gives this implementation's seeds, uniforms and tokens."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch
from safetensors.torch import load_file

from rewind.engine.model.model import GPT
from rewind.engine.posttrain.generation import sample_completions
from rewind.states.config import ArchitectureSection
from rewind.states.events import RolloutsRecorded
from rewind.stores.runs import read_seq_events
from tests.conftest import REPO
from tests.engine.test_loop import run_cli

DOC = REPO / "docs" / "sampling.md"
ARCH = ArchitectureSection(block_size=32, vocab_size=48, num_layers=2, num_heads=2, d_model=16)
END = 3  # the end token of the tiny model's completions


# --- the recipe, from the page's words -------------------------------------------------------------


def seed_of(*parts: int | str) -> int:
    """Section 2: tag, 4-byte little-endian length, payload; BLAKE2b-64 personalised; the top bit cleared."""
    digest = hashlib.blake2b(digest_size=8, person=b"rewind.rng.v1")
    for part in parts:
        payload = part.encode("utf-8") if isinstance(part, str) else str(part).encode("ascii")
        digest.update(
            (b"s" if isinstance(part, str) else b"i") + len(payload).to_bytes(4, "little") + payload
        )
    return int.from_bytes(digest.digest(), "little") & (2**63 - 1)


def uniform_of(seed: int) -> float:
    """Section 3: the first float64 of a CPU torch.Generator seeded with it."""
    return float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))


def token_of(logits: torch.Tensor, temperature: float, u: float) -> int:
    """Section 4: the inverse CDF of softmax((logits - max) / T) in float64 at u, capped at the last
    token with any probability."""
    z = logits.double()
    probs = torch.softmax((z - z.max()) / temperature, dim=-1)
    cumulative = torch.cumsum(probs, dim=-1)
    below = int((cumulative <= u * cumulative[-1]).sum())
    return min(below, int(torch.nonzero(probs > 0).max()))


@torch.no_grad()
def redraw(
    model, prompt: list[int], key: tuple, *, max_new_tokens: int, temperature: float, end: int
) -> list[int]:
    """One completion of `prompt` keyed (seed, stage, step, prompt_id, g): each token from a whole forward
    over prompt + completion so far (no KV cache), the model in eval mode."""
    seed, *rest = key
    tokens: list[int] = []
    for k in range(max_new_tokens):
        logits = model(torch.tensor([prompt + tokens]))[0, -1]
        tokens.append(token_of(logits, temperature, uniform_of(seed_of(seed, "rollout", *rest, k))))
        if tokens[-1] == end:
            break
    return tokens


def page_code() -> dict:
    """The page's Python block, run."""
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


# --- the sampler draws what the recipe says --------------------------------------------------------

PROMPTS = [[5, 14, 15, 9, 2, 6], [7, 35], [8, 9, 7, 9, 30, 2, 3, 8, 4]]


@pytest.mark.parametrize(
    ("seed", "stage", "step", "ids", "temperature"),
    [
        (7, 2, 11, ["reverse:17", "add:0", "sort:1048575"], 1.0),
        (123456789, 0, 0, ["my data:5", "é:3", "reverse:17"], 0.7),
        (3, "eval", 0, [0, 1, 255], 1.3),  # the boundary figures' keys: integer prompt ids
    ],
)
def test_the_recipe_redraws_the_sampler_s_tokens(seed, stage, step, ids, temperature):
    model = GPT(ARCH, seed=5).eval()
    with torch.no_grad():
        model.head.weight.mul_(4.0)  # peaked enough that some completions end early
    drawn = sample_completions(
        model, PROMPTS, samples_per_prompt=3, max_new_tokens=10, temperature=temperature, seed=seed,
        stage=stage, step=step, prompt_ids=ids, eos_id=END,
    )  # fmt: skip
    for c in drawn:
        prompt = PROMPTS[ids.index(c.prompt_id)]
        key = (seed, stage, step, c.prompt_id, c.sample_index)
        assert redraw(model, prompt, key, max_new_tokens=10, temperature=temperature, end=END) == c.tokens
    assert len({tuple(c.tokens) for c in drawn}) > len(drawn) // 2  # the keys draw different completions


def test_the_key_s_every_part_moves_the_draw():
    """A recipe that left a part out, or took them in another order, would fail the re-draws above: each
    part changes the seed."""
    base = (7, "rollout", 2, 11, "reverse:17", 1, 4)
    others = (8, "eval", 3, 12, "reverse:18", 2, 5)
    variants = [(*base[:i], part, *base[i + 1 :]) for i, part in enumerate(others)]
    variants.append((7, "rollout", 11, 2, "reverse:17", 1, 4))
    assert len({seed_of(*key) for key in [base, *variants]}) == len(variants) + 1


# --- a trained run's rollout batch, from its record --------------------------------------------------

CONFIG = """
[run]
seed = 7

[architecture]
block_size = 32
num_layers = 1
num_heads = 2
d_model = 16

[training]
batch_size = 8

[optimization]
lr = 3e-3
schedule = "constant"

[[stages]]
tokens = 512
datasets = [{ name = "grammar", rate = 1.0 }]
overlap = 0.0

[[stages]]
strategy = "grpo"
tokens = 256
datasets = [{ name = "reverse", rate = 0.5 }, { name = "add", rate = 0.5 }]

[stages.grpo]
group_size = 4
max_new_tokens = 8
temperature = 0.8
"""


def test_a_run_s_rollout_batch_is_redrawn_from_its_record_file_and_checkpoint(tmp_path):
    from rewind.tools.sample_cmd import model_at

    config = tmp_path / "keys.toml"
    config.write_text(CONFIG)
    code, _, err = run_cli("train", config, "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 0, err
    (record,) = [e for _, e in read_seq_events(tmp_path / "run") if isinstance(e, RolloutsRecorded)]
    assert (record.stage, record.step) == (1, 2)  # two pretraining steps, then the grpo stage's window
    names = ["reverse", "add"]  # the stage's datasets, in its order
    batch = load_file(str(tmp_path / "run" / record.path))
    model = model_at(str(tmp_path / "run"), record.step).model.eval()  # the boundary's checkpoint
    group, redrawn, recorded = record.group_size, [], []
    for n in range(batch["completions"].shape[0]):
        p = n // group
        prompt = batch["prompts"][p, : int(batch["prompt_lengths"][p])].tolist()
        prompt_id = f"{names[int(batch['prompt_sources'][p])]}:{int(batch['prompt_rows'][p])}"
        key = (7, record.stage, record.step, prompt_id, n % group)
        redrawn.append(redraw(model, prompt, key, max_new_tokens=8, temperature=0.8, end=10))
        recorded.append(batch["completions"][n, : int(batch["completion_lengths"][n])].tolist())
    assert redrawn == recorded
    assert any(len(c) < 8 for c in recorded) or len({tuple(c) for c in recorded}) > 1


# --- the page's own code ---------------------------------------------------------------------------


def test_the_page_s_python_gives_the_recipe_s_seeds_uniforms_and_tokens():
    code = page_code()
    keys = [
        (7, "rollout", 2, 11, "reverse:17", 0, 0),
        (0, "rollout", "eval", 0, 12, 3, 15),
        (2**40 + 3, "rollout", 1, 2, "é:-1", 1, 7),
        (-5, "rollout", 0, 0, "", 0, 0),
    ]
    for key in keys:
        assert code["key_seed"](*key) == seed_of(*key)
        assert code["key_uniform"](seed_of(*key)) == uniform_of(seed_of(*key))
    generator = torch.Generator().manual_seed(0)
    for case in range(200):
        logits = torch.randn(int(torch.randint(2, 60, (), generator=generator)), generator=generator) * 3
        if case % 4 == 0:
            logits[int(torch.randint(len(logits), (), generator=generator))] = -1e4  # no probability at all
        temperature = [1.0, 0.5, 2.0, 0.05][case % 4]
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        assert code["token_at"](logits.tolist(), temperature, u) == token_of(logits, temperature, u)
    # u * c[-1] at the total (what rounding can give): the last token with probability, never the one past it
    assert (
        code["token_at"]([0.0, 0.0, -1e4], 1.0, 1.0)
        == token_of(torch.tensor([0.0, 0.0, -1e4]), 1.0, 1.0)
        == 1
    )


def test_the_page_names_the_parts_this_test_implements():
    text = DOC.read_text()
    for words in ('(seed, "rollout", stage, step, prompt_id, g, k)', "`rewind.rng.v1`", "`s mod 2**32`",
                  "((a * 2**32 + b) mod 2**53) / 2**53", "`c[i] > u * c[-1]`"):  # fmt: skip
        assert words in text, words
