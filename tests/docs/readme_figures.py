"""What the README's checks share: where the figures live, which machine made them, how blocks are marked.

A README block is checked in one of two ways, by the HTML comment on the line before its fence:
- `<!-- figure: docs/figures/NAME.txt -->`: the block is exactly that file, which
  `tests/docs/make_readme_figures.py` wrote from a demo run (figures that depend on the machine kind);
- `<!-- output: rewind ARGS -->`: the block is `$ rewind ARGS` and then exactly what that command prints,
  re-run by the tests on every machine (dry runs and config errors, which no CPU changes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FIGURES_DIR = REPO / "docs" / "figures"
_MARKER = re.compile(r"^<!-- (figure|output): (.+?) -->$")


_PROBE = (
    "import json, platform, torch; print(json.dumps({'torch': torch.__version__, "
    "'cpu_capability': torch.backends.cpu.get_cpu_capability(), 'threads': torch.get_num_threads(), "
    "'machine': platform.machine()}))"
)


def machine_fingerprint() -> dict:
    """What a CPU run's bits depend on besides the code (torch build, kernel capability, threads), as a
    fresh process like `rewind train` sees them (this one's may have been changed by what it ran)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout)


def marked_blocks(text: str) -> list[tuple[str, str, str]]:
    """(kind, argument, block content) of every marked fenced block, in README order."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = _MARKER.match(line.strip())
        if not match:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"README line {i + 1}: a marker must be followed by a fenced block")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        found.append((match.group(1), match.group(2), "\n".join(lines[i + 2 : end]) + "\n"))
    return found
