"""docs/sampling.md says the least temperature a grpo stage accepts, the config check's own
(rewind.states.stagekinds.rules.MIN_TEMPERATURE), not that only 0 is refused."""

from __future__ import annotations

from rewind.states.stagekinds.rules import MIN_TEMPERATURE
from tests.docs.readme_figures import REPO


def test_the_page_gives_the_grpo_temperature_floor_the_check_applies():
    text = (REPO / "docs" / "sampling.md").read_text()
    assert f"(> 0; a grpo stage's is at least {MIN_TEMPERATURE:g})" in text
    assert "grpo refuses 0)" not in text
