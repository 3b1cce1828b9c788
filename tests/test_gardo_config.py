"""GARDO's keys refused where they cannot train, each in one line naming the key, the value and the fix; its defaults
resolve to the reference's (every step SDE, the first int(N x 0.89) trained); a GARDO key under another algorithm is
refused as every algorithm's section is."""

from __future__ import annotations

import pytest

from sp_diffusers.flowgrpo.algorithms.registry import algorithm_for, check_algorithm_keys
from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig

REWARDS = [{"fn": "color", "weight": 1.0}, {"fn": "mean_latent", "weight": 0.0}]


def _config(**gardo) -> TrainConfig:
    c = TrainConfig()
    c.flowgrpo.algorithm, c.flowgrpo.rewards = "gardo", list(REWARDS)
    c.flowgrpo.gardo.features, c.flowgrpo.gardo.main_reward = "latents", "color"
    c.flowgrpo.gardo.aux_rewards = ["mean_latent"]
    for key, value in gardo.items():
        if "." in key:
            section, name = key.split(".")
            setattr(getattr(c, section), name, value)
        else:
            setattr(c.flowgrpo.gardo, key, value)
    return c


def test_defaults_are_the_reference_s():
    algorithm = algorithm_for(_config())
    assert algorithm.sde_steps(algorithm.config) == "all"
    assert algorithm.trained_count(algorithm.config) == int(8 * 0.89) == 7
    assert algorithm.inputs().reference  # kl_coef 0.04: the reference's step is evaluated
    assert algorithm.image_features() == "latents"
    assert algorithm_for(_config(features="none")).image_features() is None


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"features": ""}, r"flowgrpo.gardo.features is empty: .*fix: the folder of a DINOv2 or DINOv3 model"),
        ({"features": "/no/such/dino"}, r"flowgrpo.gardo.features='/no/such/dino' is not a model folder \(no "
         r"config.json\); fix: a folder written by save_pretrained"),
        ({"main_reward": "ocr"}, r"flowgrpo.gardo.main_reward: \['ocr'\] is not a configured reward \(flowgrpo.rewards "
         r"names: \['color', 'mean_latent'\]\)"),
        ({"aux_rewards": ["aesthetic"]}, r"flowgrpo.gardo.aux_rewards: \['aesthetic'\] is not a configured reward"),
        ({"aux_rewards": ["color", "mean_latent"]}, r"aux_rewards=\['color', 'mean_latent'\] holds the main reward"),
        ({"kl_fraction": 0.5}, r"flowgrpo.gardo.kl_fraction=0.5 and kl_fraction_range=\[0.02, 0.2\] must satisfy"),
        ({"kl_fraction_range": [0.0, 0.2]}, r"must satisfy 0 < low <= kl_fraction <= high <= 1"),
        ({"kl_coef": -1.0}, r"flowgrpo.gardo.kl_coef=-1.0 must be a finite number >= 0"),
        ({"reset_kl": float("nan")}, r"flowgrpo.gardo.reset_kl=nan must be a finite number >= 0"),
        ({"kl_window": 0}, r"flowgrpo.gardo.kl_window=0 must be an integer >= 1"),
        ({"reset_every": 2.5}, r"flowgrpo.gardo.reset_every=2.5 must be an integer >= 1"),
        ({"flowgrpo.sde_type": "cps"}, r"flowgrpo.sde_type=cps with flowgrpo.gardo.kl_coef=0.04: .*fix: "
         r"flowgrpo.sde_type=sde"),
    ],
    ids=["no_features", "missing_folder", "unknown_main", "unknown_aux", "main_in_aux", "fraction_outside", "range_from_0",
         "negative_kl", "nan_reset", "window_0", "reset_every_float", "cps"],
)
def test_a_key_that_cannot_train_is_refused_in_one_line(keys, message):
    with pytest.raises(ConfigError, match=message):
        check_algorithm_keys(_config(**keys))


def test_a_gardo_key_under_another_algorithm_is_refused():
    c = TrainConfig()
    c.flowgrpo.gardo.kl_coef = 0.07
    with pytest.raises(ConfigError, match=r"flowgrpo.gardo.kl_coef=0.07: read by gardo only"):
        check_algorithm_keys(c)
