"""``model.overrides`` on a tiny model: ``num_layers`` is the layer count whatever the class calls it (Z-Image's
``n_layers``), and a key the class does not take is refused by name, not with the constructor's TypeError."""

from __future__ import annotations

import pytest

from sp_diffusers.tiny import tiny_model, tiny_model_config


def test_num_layers_reaches_a_class_that_names_it_otherwise():
    model = tiny_model("zimage", num_layers=1)
    assert model.config.n_layers == 1 and len(model.layers) == 1
    assert tiny_model_config("zimage", num_layers=3)["n_layers"] == 3
    assert tiny_model("qwenimage", num_layers=1).config.num_layers == 1  # a class that takes num_layers itself


def test_a_key_the_class_does_not_take_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model\.overrides: the tiny zimage model \(ZImageTransformer2DModel\) takes "
                       r"no bogus_key; fix: use its constructor's keys \(.*n_layers"):
        tiny_model("zimage", bogus_key=1)
