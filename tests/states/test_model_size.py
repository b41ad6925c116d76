"""A model's size from its architecture in one place (rewind.states.model_size): the MLP's width the
engine's model, the exports and the continuation check build on, and PaLM's FLOPs the thread count and
`rewind bench mfu` report."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from rewind.states.config import ArchitectureSection
from rewind.states.model_size import flops_per_token, matmul_parameters, mlp_width

ROOT = Path(__file__).resolve().parents[2]
ARCH = ArchitectureSection(block_size=32, vocab_size=256, num_layers=2, num_heads=4, d_model=32)


def test_d_ff_0_is_four_times_d_model_and_any_other_is_itself():
    assert mlp_width(ARCH) == 128
    assert mlp_width(msgspec.structs.replace(ARCH, d_ff=24)) == 24


def test_matmul_parameters_are_attention_mlp_and_head():
    assert matmul_parameters(ARCH) == 2 * (4 * 32 * 32 + 2 * 32 * 128) + 32 * 256
    swiglu = msgspec.structs.replace(ARCH, mlp="swiglu", d_ff=40)
    assert matmul_parameters(swiglu) == 2 * (4 * 32 * 32 + 3 * 32 * 40) + 32 * 256


def test_flops_per_token_are_palm_s_6n_plus_12_l_d_t():
    assert flops_per_token(ARCH, 1000) == 6 * 1000 + 12 * 2 * 32 * 32


def test_no_module_but_model_size_spells_the_d_ff_rule():
    """The rule has one home: a copy of `d_ff or 4 * d_model` elsewhere would drift from it."""
    spelled = re.compile(r"d_ff\W*\s+or\s+4\s*\*")
    copies = [
        str(path.relative_to(ROOT))
        for folder in ("states", "engine", "stores", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "model_size.py" and spelled.search(path.read_text(encoding="utf-8"))
    ]
    assert copies == []
