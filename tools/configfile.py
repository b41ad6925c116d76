"""Reading a config file from disk (states/ is pure, so the I/O lives here)."""

from __future__ import annotations

from pathlib import Path

from rewind.states.config import Config, ConfigError, loads_config
from rewind.tools.errors import UsageError


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load and validate a TOML config; raises ConfigError (all problems) or UsageError (no file)."""
    file = Path(path)
    if not file.exists():
        raise UsageError(f"{path}: no such config file")
    if file.is_dir():
        raise UsageError(f"{path}: is a directory, expected a TOML config file")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read config ({exc})") from None
    config = loads_config(text, source=str(path), overrides=overrides)
    return _resolve_data_paths(config, file.parent)


def _resolve_data_paths(config: Config, base: Path) -> Config:
    """Relative dataset paths are relative to the config file, not to the current directory."""
    if not config.data:
        return config
    import msgspec

    data = {
        name: msgspec.structs.replace(src, path=str((base / src.path).resolve()))
        if "://" not in src.path and not Path(src.path).is_absolute()
        else src
        for name, src in config.data.items()
    }
    return msgspec.structs.replace(config, data=data)


__all__ = ["ConfigError", "load_config"]
