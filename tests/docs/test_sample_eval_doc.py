"""docs/sample_eval.md lists every key `rewind sample --json` prints, in its order, and no other."""

from __future__ import annotations

import json
import re

from tests.conftest import REPO
from tests.engine.test_loop import run_cli, straight_run


def test_the_json_keys_the_page_lists_are_the_ones_printed(tmp_path_factory):
    page = (REPO / "docs" / "sample_eval.md").read_text()
    said = page.split("`--json` prints one object: ", 1)[1].split("\n\n", 1)[0].replace("\n", " ")
    listed = re.findall(r"(?:^|, )`([a-z_]+)`", re.sub(r"\([^)]*\)", "", said))  # not what (...) say of them
    run = straight_run(tmp_path_factory)
    code, out, err = run_cli("sample", run, "--prompt", "rev abc=", "--max-tokens", "4", "--json")
    assert code == 0, err
    assert listed == list(json.loads(out))
