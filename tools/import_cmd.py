"""`rewind import-config THESEUS.yaml > run.toml`: an ABCD trainer YAML config as a rewind config.

The TOML goes to stdout; stderr says, one line each, which LR schedule the import chose and why, which
datasets became `[data.NAME]` stubs to fill, every other choice that changes what trains, and every key
with no counterpart ("rewind: import: <yaml path>: no counterpart (<why>)"). The output is checked
against rewind's config rules before it is printed, so a config the import writes is one `rewind
schedule` accepts (once the stubs' paths are filled, one `rewind train` can run).

docs/migrating.md lists where rewind deliberately behaves differently from the original.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rewind.tools.errors import UsageError

PREFIX = "rewind: import: "


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import-config",
        help="translate an ABCD trainer YAML config into a rewind TOML config (stdout); stderr names what "
        "has no counterpart",
    )
    p.add_argument("config", help="the ABCD trainer's YAML config")
    p.add_argument("--name", help="run.name of the imported config (default: the YAML file's stem)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rewind.tools.import_mapping import translate
    from rewind.tools.import_yaml import Notes, YamlConfig, read_yaml

    yaml_config = YamlConfig(read_yaml(args.config), args.config)
    notes = Notes()
    from rewind.states.stageform import to_stage_form

    # Translated as the YAML lays it out (flat per-stage lists: problems name them as the YAML does),
    # written as [[stages]] records.
    config = translate(yaml_config, args.name or Path(args.config).stem, notes)
    check_imported(config, args.config)
    sys.stdout.write(render(to_stage_form(config)[0], args.config))
    for line in notes.render():
        print(PREFIX + line, file=sys.stderr)
    return 0


def render(config: dict[str, Any], source: str) -> str:
    from rewind.states.tomlwrite import dumps

    # A file name is not TOML: keep the comment on one line whatever the name holds.
    shown = "".join(c if c.isprintable() else "?" for c in Path(source).name)
    header = [f"# Imported from {shown} by `rewind import-config`."]
    if config.get("data"):
        header.append(
            "# Before training, fill in the path of every [data.*] stub (datasets rewind does not have)."
        )
    return "\n".join(header) + "\n\n" + dumps(config)


def check_imported(config: dict[str, Any], source: str) -> None:
    """UsageError (one line, every problem) if rewind's config rules refuse the imported config: a
    value the original accepted that rewind does not (a rate of 0, betas of the wrong length, ...)."""
    from rewind.states.config import ConfigError
    from rewind.states.config_reading import config_from_dict

    try:
        config_from_dict(config, source)
    except ConfigError as exc:
        raise UsageError(
            f"{source}: the imported config breaks rewind's rules: {'; '.join(exc.problems)}"
        ) from None
