"""docs/training.md's "Config keys" table is the trainer's config as the code has it: every key, each default."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import pytest

from sp_diffusers.flowgrpo.config import TrainConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def _defaults(section: object = None, prefix: str = "") -> dict[str, str]:
    out = {}
    section = TrainConfig() if section is None else section
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):  # a section, or an algorithm's section of flowgrpo
            out.update(_defaults(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = json.dumps(value)
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


def test_an_old_flat_key_loads_into_its_section_with_a_warning(tmp_path):
    """One release of grace: ``flowgrpo.mix_window_size`` (YAML, an override, or the attribute) sets
    ``flowgrpo.mix.window_size`` and warns naming the new key; a key that never existed is still refused."""
    import pytest

    from sp_diffusers.flowgrpo.config import FLAT_KEYS, ConfigError, load_config

    path = tmp_path / "old.yaml"
    path.write_text("flowgrpo:\n  algorithm: mix_grpo\n  mix_window_size: 3\n  nft_beta: 0.5\n")
    with pytest.warns(FutureWarning, match=r"flowgrpo\.mix_window_size is now flowgrpo\.mix\.window_size"):
        config = load_config(path, ["flowgrpo.guard_bias=batch"])
    assert (config.flowgrpo.mix.window_size, config.flowgrpo.nft.beta, config.flowgrpo.guard.bias) == (3, 0.5, "batch")
    with pytest.warns(FutureWarning, match=r"flowgrpo\.dance_kl is now flowgrpo\.dance\.kl"):
        config.flowgrpo.dance_kl = "flow_grpo"
    assert config.flowgrpo.dance.kl == "flow_grpo"
    with pytest.raises(ConfigError, match=r"unknown config key 'flowgrpo\.mix\.window'"):
        load_config(None, ["flowgrpo.mix.window=3"])
    # every old key names a key its section has
    for old, (section, key) in FLAT_KEYS.items():
        assert hasattr(getattr(TrainConfig().flowgrpo, section), key), old


@pytest.mark.parametrize(
    "keys, unread",
    [
        ({"algorithm": "dance_grpo", "window_range": [1, 2]}, "flowgrpo.window_range=[1, 2]"),
        ({"algorithm": "mix_grpo", "shift": 3.0, "timestep_fraction": 0.5}, "flowgrpo.timestep_fraction=0.5"),
        ({"algorithm": "diffusion_nft", "clip_range": 0.2}, "flowgrpo.clip_range=0.2"),
        ({"algorithm": "flow_grpo", "timestep_fraction": 0.5}, "flowgrpo.timestep_fraction=0.5"),  # window mode
        ({"algorithm": "grpo_guard", "window_size": 3}, "flowgrpo.window_size=3"),  # all mode: no window
    ],
)
def test_a_shared_key_the_algorithm_does_not_read_is_warned_with_its_name(keys, unread):
    """Shared keys are warned, not refused: a config written for one algorithm, switched to another, carries them."""
    from sp_diffusers.flowgrpo.algorithms.registry import UnreadKeyWarning
    from sp_diffusers.flowgrpo.build import check_algorithm
    from sp_diffusers.flowgrpo.config import TrainConfig

    c = TrainConfig()
    for k, v in keys.items():
        setattr(c.flowgrpo, k, v)
    with pytest.warns(UnreadKeyWarning, match=rf"{re.escape(unread)}: flowgrpo.algorithm={keys['algorithm']} .* does "
                      r"not read it, so it changes nothing in this run; fix: drop it"):
        check_algorithm(c)
    read = TrainConfig()
    read.flowgrpo.window_range = [1, 2]  # flow_grpo reads its window: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnreadKeyWarning)
        check_algorithm(read)
