"""What a reward function's code is, for the record: its module's file and the modules of yours it imports.

A module's identity (RolloutsRecorded.reward_code holds one per function) reads

    sha256:<its file's sha256>[;imports=<module>:<16 hex>,...][;version=<its __version__>]

`imports` names, in name order, every module of yours it imports, each with the first IMPORT_DIGITS hex
digits of the sha256 of its file: a module an import statement asks for, or any module loaded, while the
reward module is imported or its functions are tried (rewind.engine.posttrain.rewards.try_rewards); one a covered
module's globals name (a module, or a function or class defined in one); and so on through every module
covered. "Yours" is a module with a file outside Python's installation (the standard library,
site-packages, dist-packages) and outside rewind. A module a function imports only on a later call, for a
completion unlike the trial's, is not covered: a resume repeats the import and the trial, so it computes
the identity the run recorded.

An identity without `imports` (recorded before rewind covered them, or of a module that imported none of
yours) is compared by its file and version alone (`code_change`).
"""

from __future__ import annotations

import builtins
import hashlib
import importlib.util
import re
import site
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import FunctionType, ModuleType

IMPORT_DIGITS = 16
IDENTITY = re.compile(r"sha256:([0-9a-f]{64})(?:;imports=([^;]*))?(?:;version=(.*))?", re.DOTALL)
# What each module asked for while watched (its import statements, cached modules included), and what
# was loaded at all while a reward module was imported or tried (under that module's name).
_IMPORTED: dict[str, set[str]] = {}


@contextmanager
def watching(owner: str) -> Iterator[None]:
    """Note what the block imports (module doc): every import statement, by the module whose it is, and
    every module loaded, by `owner`. The statements are seen through builtins.__import__, for the block
    only."""
    before, original = set(sys.modules), builtins.__import__

    def noting(name, globals=None, locals=None, fromlist=(), level=0):
        module = original(name, globals, locals, fromlist, level)
        _note(name, globals, fromlist, level)
        return module

    builtins.__import__ = noting
    try:
        yield
    finally:
        builtins.__import__ = original
        _IMPORTED.setdefault(owner, set()).update(set(sys.modules) - before)


def _note(name: str, globals: object, fromlist: object, level: int) -> None:
    importer = globals.get("__name__") if isinstance(globals, dict) else None
    if not isinstance(importer, str):
        return
    try:
        full = importlib.util.resolve_name("." * level + name, globals.get("__package__")) if level else name
    except (ImportError, ValueError, TypeError, AttributeError):
        return
    parts = full.split(".")
    asked = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # its packages run too
    asked.update(f"{full}.{item}" for item in fromlist or () if isinstance(item, str))  # `from pkg import sub`
    _IMPORTED.setdefault(importer, set()).update(asked)


def forget(name: str) -> None:
    """What `name` imported, noted when it was imported before: it is about to be imported again."""
    _IMPORTED.pop(name, None)


def module_identity(module_name: str) -> str:
    """The identity of the imported module `module_name` (module doc); its file must exist."""
    module = sys.modules[module_name]
    identity = "sha256:" + _digest(Path(module.__file__))
    imports = imports_of(module_name)
    if imports:
        digests = (f"{name}:{_digest(path)[:IMPORT_DIGITS]}" for name, path in sorted(imports.items()))
        identity += ";imports=" + ",".join(digests)
    version = getattr(module, "__version__", None)
    return identity + (f";version={version}" if isinstance(version, str) else "")


def imports_of(module_name: str) -> dict[str, Path]:
    """The modules of yours `module_name` imports, directly or through one another: name -> file."""
    found: dict[str, Path] = {}
    todo = [module_name]
    while todo:
        name = todo.pop()
        for other in sorted(_IMPORTED.get(name, set()) | _named_by(sys.modules.get(name))):
            if other != module_name and other not in found and (path := user_file(other)) is not None:
                found[other] = path
                todo.append(other)
    return found


def _named_by(module: ModuleType | None) -> set[str]:
    """The modules a module's globals name: modules, and those functions and classes are defined in."""
    names: set[str] = set()
    for value in list(vars(module).values()) if isinstance(module, ModuleType) else ():
        if isinstance(value, ModuleType):
            name = getattr(value, "__name__", None)
        elif isinstance(value, FunctionType | type):
            name = getattr(value, "__module__", None)
        else:
            continue
        if isinstance(name, str):
            names.add(name)
    return names


def user_file(name: str) -> Path | None:
    """The file of the imported module `name` when it is yours (module doc), else None."""
    if name in ("__main__", "rewind") or name.startswith("rewind."):
        return None
    source = getattr(sys.modules.get(name), "__file__", None)
    if not isinstance(source, str):
        return None  # built in, or a namespace package: no file of its own
    path = Path(source).resolve()
    if not path.is_file() or {"site-packages", "dist-packages"} & set(path.parts):
        return None
    return None if any(path.is_relative_to(root) for root in _installation()) else path


@cache
def _installation() -> tuple[Path, ...]:
    """Where the standard library and installed packages are: this environment's and its base's."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    schemes = (sysconfig.get_paths(), sysconfig.get_paths(vars=base))
    roots = {paths[key] for paths in schemes for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update([*site.getsitepackages(), site.getusersitepackages()])
    return tuple(Path(root).resolve() for root in roots)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_change(module_name: str, was: str, now: str) -> str:
    """What changed from the identity `was` to `now` of `module_name`'s code, "" when it is the same code
    (an identity without imports compares by file and version: module doc)."""
    if was == now:
        return ""
    recorded, current = IDENTITY.fullmatch(was), IDENTITY.fullmatch(now)
    if recorded is None or current is None:
        return f"it was {_short(was)}, now {_short(now)}"
    (file_was, imports_was, version_was), (file_now, imports_now, version_now) = recorded.groups(), current.groups()
    if file_was != file_now:
        source = getattr(sys.modules.get(module_name), "__file__", module_name)
        return f"the content of its module's file {source} changed (sha256 {file_was[:12]}... -> {file_now[:12]}...)"
    if imports_was is not None and imports_was != (imports_now or ""):
        before, after = _imports(imports_was), _imports(imports_now or "")
        changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        return "the content of the modules it imports changed: " + ", ".join(
            f"{name} ({_where(name, before, after)})" for name in changed[:5]
        ) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    if version_was != version_now:
        return f"its __version__ changed ({_short(version_was or '(none)')} -> {_short(version_now or '(none)')})"
    return ""


def _imports(text: str) -> dict[str, str]:
    return dict(item.rpartition(":")[::2] for item in text.split(",") if item)


def _where(name: str, before: dict[str, str], after: dict[str, str]) -> str:
    if name not in after:
        return "no longer imported"
    file = user_file(name)
    return f"{file}, {'newly imported' if name not in before else 'changed'}"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
