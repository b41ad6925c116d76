"""From the clone root, rewind's `kernels/` folder is not taken for Hugging Face's `kernels` package.

`python -c`, `python -m` and pytest put the working directory first on sys.path, where the folder is found
as a top-level `kernels`: the kernel-hub package bitsandbytes imports (`from kernels import get_kernel`, on
CPUs with AVX512-BF16) and transformers probes (`is_kernels_available`). Each check runs Python from the
clone root with warnings as errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

# What each probe sees of a top-level `kernels`, printed as JSON; bitsandbytes' own import comes last so
# that what it logs on stderr is checked too.
PROBES = """
import json, sys
try:
    from kernels import get_kernel  # bitsandbytes' probe (backends/cpu/ops.py)
    error = None
except ImportError as e:
    error = str(e)
from transformers.utils.import_utils import _is_package_available, is_kernels_available
found = _is_package_available("kernels", return_version=True)
import rewind.kernels
loaded = sys.modules.get("kernels")
seen = {"error": error, "transformers": [*found, is_kernels_available()],
        "file": getattr(loaded, "__file__", None), "ours": rewind.kernels.__file__}
import bitsandbytes
print(json.dumps(seen))
"""


def from_the_root(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "error", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
        timeout=300,
    )


def test_without_the_hub_package_every_probe_finds_none_and_nothing_names_the_folder():
    done = from_the_root("-c", PROBES)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    folder = str(REPO / "kernels")
    # As from any other directory: no get_kernel, transformers' "not installed", no module file.
    assert seen["error"] is not None and folder not in seen["error"], seen
    assert seen["transformers"] == [False, "N/A", False], seen
    assert seen["file"] is None, seen
    assert seen["ours"] == str(REPO / "kernels" / "__init__.py")  # rewind.kernels is still this folder
    # bitsandbytes logs its missing CPU kernel on some CPUs, but never with this folder in the line.
    assert folder not in done.stderr, done.stderr


def test_the_hub_package_installed_elsewhere_is_the_one_imported_from_the_root(tmp_path):
    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text(
        '__version__ = "0.12.0"\nfrom kernels.hub import get_kernel\n', encoding="utf-8"
    )
    (hub / "hub.py").write_text(
        "def get_kernel(repo_id, version=None):\n    return repo_id\n", encoding="utf-8"
    )
    code = (
        "import sys; from kernels import get_kernel; import kernels, rewind.kernels\n"
        "print(get_kernel('kernels-community/x'), kernels.__file__, rewind.kernels.__name__)"
    )
    # PYTHONPATH comes after the working directory on sys.path: the folder is found first.
    done = from_the_root("-c", code, PYTHONPATH=str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["kernels-community/x", str(hub / "__init__.py"), "rewind.kernels"]


def test_python_m_rewind_from_the_root_is_the_command():
    done = from_the_root("-m", "rewind", "schedule", str(REPO / "examples" / "tiny.toml"), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["events"], done.stderr
