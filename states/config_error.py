"""`ConfigError`: every problem found in a config, raised where a config is read, overridden or
translated (`rewind.states.config_reading`, `overrides`, `stageform`). A leaf, so that none of them
imports another to raise it."""

from __future__ import annotations


class ConfigError(Exception):
    """Every problem found in a config, each as 'dotted.path: what is wrong'."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        self.source = source
        super().__init__(f"{source}: " + "; ".join(self.problems))

    def lines(self) -> list[str]:
        return [f"{self.source}: {p}" for p in self.problems]
