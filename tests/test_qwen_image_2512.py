"""Qwen-Image-2512 is a new release of Qwen-Image's weights on the same architecture: the existing adapter, plan
and trainer take its released config (issue 41).

Its published ``transformer/config.json`` (planner.released_configs.QWEN_IMAGE_2512) builds the installed
QwenImageTransformer2DModel with the published size (~20.4 B parameters, 20,430,401,088 counted here on the meta
device); the Qwen-Image adapter lays a 1328 x 1328 image out as the 6,889 tokens of 83 x 83 patches its pipeline
uses, and the model's forward takes them (meta tensors: no memory). Its pipeline class is QwenImagePipeline, whose
inputs tests/test_pipeline_io.py holds for the family.
"""

from __future__ import annotations

import torch


def test_the_released_config_builds_the_model_the_adapter_feeds():
    from diffusers import QwenImageTransformer2DModel

    from sp_diffusers.flowgrpo.models.adapters import QwenImageAdapter, build_adapter
    from sp_diffusers.planner.released_configs import QWEN_IMAGE, QWEN_IMAGE_2512

    assert QWEN_IMAGE_2512 == QWEN_IMAGE  # the keys that size the model: the same architecture
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**QWEN_IMAGE_2512)
    assert sum(p.numel() for p in model.parameters()) == 20_430_401_088
    adapter = build_adapter(model, 1328 // 8)
    assert isinstance(adapter, QwenImageAdapter)
    x = torch.zeros(1, *adapter.latent_shape(1)[1:], device="meta")
    mask = torch.ones(1, 20, dtype=torch.bool, device="meta")
    inputs = adapter.inputs(x, torch.tensor(500.0, device="meta"), torch.zeros(1, 20, 3584, device="meta"), mask)
    assert tuple(inputs["hidden_states"].shape) == (1, 83 * 83, 64) and inputs["img_shapes"] == [[(1, 83, 83)]]
    assert tuple(model(**inputs).sample.shape) == (1, 6889, 64)


def test_plan_has_it_built_in():
    from sp_diffusers.planner.models import BUILTIN

    spec = BUILTIN["qwen-image-2512"]
    assert spec.kind == "qwenimage" and spec.source == "Qwen/Qwen-Image-2512"
    assert spec.config == BUILTIN["qwen-image"].config and spec.default_size == (1328, 1328, 1)
