"""docs/training.md's "Config keys" table is the trainer's config as the code has it: every key, each default."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from sp_diffusers.flowgrpo.config import TrainConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def _defaults() -> dict[str, str]:
    out = {}
    config = TrainConfig()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            for g in dataclasses.fields(value):
                out[f"{f.name}.{g.name}"] = json.dumps(getattr(value, g.name))
        else:
            out[f.name] = json.dumps(value)
    return out


def _table() -> dict[str, str]:
    section = DOC.read_text().split("## Config keys", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]*)` \| [^|]+", section, flags=re.M)
    return dict(rows)


def test_every_config_key_is_documented_with_its_default():
    documented, defaults = _table(), _defaults()
    assert sorted(set(defaults) - set(documented)) == [], "keys missing from docs/training.md's table"
    assert sorted(set(documented) - set(defaults)) == [], "docs/training.md lists keys the config lacks"
    wrong = {k: (documented[k], v) for k, v in defaults.items() if documented[k] != v}
    assert wrong == {}, f"documented default != code default: {wrong}"
