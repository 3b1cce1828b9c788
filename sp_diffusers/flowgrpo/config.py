"""The FlowGRPO training configuration: YAML sections -> dataclasses, with errors that name the key.

A key that does not exist is refused with the closest valid keys suggested (a typo never silently
falls back to a default); values are type-checked against the dataclass fields. The sections and their defaults:
``config_schema.py``; the values that cannot train: ``config_checks.py`` (``validate``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from .config_checks import validate
from .config_schema import (
    GATHER_MODES,
    LOGGERS,
    TINY_KIND,
    ConfigError,
    DataConfig,
    FlowGRPOConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RolloutConfig,
    TextConfig,
    TrainConfig,
    TrainLoopConfig,
    UpdateConfig,
)

__all__ = [
    "GATHER_MODES",
    "LOGGERS",
    "TINY_KIND",
    "ConfigError",
    "DataConfig",
    "FlowGRPOConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RolloutConfig",
    "TextConfig",
    "TrainConfig",
    "TrainLoopConfig",
    "UpdateConfig",
    "apply_overrides",
    "load_config",
    "validate",
]


def _check_type(path: str, value: Any, annotation: Any) -> Any:
    expected = annotation if isinstance(annotation, type) else typing.get_origin(annotation) or annotation
    if isinstance(expected, str):
        expected = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "dict": dict}.get(
            expected
        )
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is float and isinstance(value, str):
        # YAML 1.1 reads "5e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if expected in (int, float, str, bool, list, dict) and not isinstance(value, expected):
        raise ConfigError(f"{path} must be {expected.__name__}, got {value!r} ({type(value).__name__})")
    if expected is int and isinstance(value, bool):
        raise ConfigError(f"{path} must be int, got {value!r}")
    return value


def _merge(obj: Any, data: dict[str, Any], prefix: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown config key '{path}'{hint} (valid: {', '.join(sorted(fields))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} is a section; give it a mapping, got {value!r}")
            _merge(current, value, f"{path}.")
        else:
            setattr(obj, key, _check_type(path, value, hints[key]))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults <- YAML file <- ``key.sub=value`` overrides (values parsed as YAML)."""
    import yaml

    config = TrainConfig()
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(
                f"--config {path}: no such file; fix: pass a YAML file (examples/configs/*.yaml)"
            )
        data = yaml.safe_load(Path(path).read_text())
        if data is None:
            # an empty file silently meaning "all defaults" is how a wrong path or a truncated file hides
            raise ConfigError(
                f"{path} is empty; fix: give it at least one section, or omit --config to run the defaults"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        _merge(config, data, "")
    apply_overrides(config, overrides or [])
    validate(config)
    return config


def apply_overrides(config: TrainConfig, overrides: list[str]) -> None:
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. flowgrpo.group_size=8)")
        key, raw = item.split("=", 1)
        value: Any = yaml.safe_load(raw)
        nested: dict[str, Any] = value
        for part in reversed(key.strip().split(".")):
            nested = {part: nested}
        _merge(config, nested, "")


_ = types  # typing helpers only
