"""What the README's checks share: where the figures live, which machine made them, how blocks are marked.

The checked pages are README.md and every Markdown page under docs/ (`doc_pages`): a block of any of them
is checked in one of two ways, by the HTML comment on the line before its fence:
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
DOCS_DIR = REPO / "docs"
FIGURES_DIR = DOCS_DIR / "figures"
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


def doc_pages() -> list[Path]:
    """README.md, then every Markdown page under docs/ (subfolders too) in path order: the pages whose
    snippets, figures and links the tests check."""
    return [README, *sorted(DOCS_DIR.rglob("*.md"))]


def marked_blocks(text: str, where: str = "README") -> list[tuple[str, str, str]]:
    """(kind, argument, block content) of every marked fenced block of one page, in page order."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = _MARKER.match(line.strip())
        if not match:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"{where} line {i + 1}: a marker must be followed by a fenced block")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        found.append((match.group(1), match.group(2), "\n".join(lines[i + 2 : end]) + "\n"))
    return found


def marked_pages() -> list[tuple[str, str, str, str]]:
    """(page, kind, argument, block content) of every marked fenced block of every checked page, the page
    as a path from the repository root."""
    found = []
    for path in doc_pages():
        where = str(path.relative_to(REPO))
        found += [(where, *block) for block in marked_blocks(path.read_text(), where)]
    return found
