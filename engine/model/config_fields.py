"""The config.json reading every model family's parser shares (engine/model/model_config.py, v4_config.py):
the error that names the field, and an int field's check."""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config.json value wideep cannot serve; the message names the field."""


def config_int(raw: dict[str, Any], key: str, default: Any = ..., *, lo: int = 1, allow_none: bool = False) -> Any:
    if key not in raw or (raw[key] is None and not allow_none):
        if default is ...:
            raise ConfigError(f"config field '{key}' is missing")
        return default
    v = raw[key]
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"config field '{key}' must be an int >= {lo}, got {v!r}")
    return v
