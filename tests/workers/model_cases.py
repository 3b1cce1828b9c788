"""The model-parity cases: one tiny model of every transformer with a context-parallel plan (diffusers' or
sp_diffusers'), each at an *even* length (every sequence the plan splits divides 4) and an *uneven* one (the
video / image tokens odd, and the text, audio and packed sequences odd where the model has them), with the
inputs the SP run gets and the output tensors a forward returns.

Imported inside spawned ranks (any diffusers version of the matrix): diffusers is only imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

LENGTHS = ("even", "uneven")


@dataclass(frozen=True)
class ModelCase:
    kind: str  # the tiny kind (sp_diffusers.tiny)
    even: dict[str, Any]  # tiny_inputs kwargs at the even length
    uneven: dict[str, Any]  # ... and at the uneven one
    overrides: dict[str, Any] = field(default_factory=dict)  # tiny config overrides, both lengths
    uneven_overrides: dict[str, Any] = field(default_factory=dict)  # ... at the uneven length only
    # the even case pads the text to the degree under SP (key mask over the padding) against the unpadded
    # reference; the uneven case passes the odd text as it is
    pad_text: bool = False


def _hw(n: int) -> tuple[int, int]:
    """Latent (H, W) giving ``n`` tokens per frame with 2 x 2 patches."""
    return {16: (8, 8), 9: (6, 6), 4: (4, 4), 3: (6, 2)}[n]


# fmt: off
MODELS: dict[str, ModelCase] = {
    # N image / video tokens, T text, A audio. Image models: patch size 1 (Flux, Flux.2) or 2.
    "flux": ModelCase("flux", dict(image_hw=(4, 4), text_len=8), dict(image_hw=(3, 3), text_len=7)),
    "flux2": ModelCase("flux2", dict(image_hw=(4, 4), text_len=8), dict(image_hw=(3, 3), text_len=7)),
    "qwenimage": ModelCase("qwenimage", dict(image_hw=_hw(16), text_len=8), dict(image_hw=_hw(9), text_len=7)),
    "sd3": ModelCase("sd3", dict(image_hw=_hw(16), text_len=9, ragged_text=False),
                     dict(image_hw=_hw(9), text_len=9, ragged_text=False), pad_text=True),
    # Z-Image pads every image and caption to a multiple of 32 tokens itself: its split lengths are multiples of
    # 32 whatever the input; the uneven case gives it odd inputs (9 image tokens, 7 caption tokens)
    "zimage": ModelCase("zimage", dict(image_hw=_hw(16), text_len=8), dict(image_hw=_hw(9), text_len=7)),
    "wan": ModelCase("wan", dict(image_hw=_hw(16), frames=1, text_len=8), dict(image_hw=_hw(9), frames=1, text_len=7)),
    # 512 text tokens: Wan-I2V-style processors tell the image tokens from the text by position (text = last 512)
    "chronoedit": ModelCase("chronoedit", dict(image_hw=_hw(4), frames=2, text_len=512),
                            dict(image_hw=_hw(3), frames=3, text_len=512, per_token_timestep=True)),
    "wanvace": ModelCase("wanvace", dict(image_hw=_hw(16), frames=1, text_len=8),
                         dict(image_hw=_hw(9), frames=1, text_len=7)),
    # even: no history (16 tokens); uneven: 21 history + 16 current tokens (at SP = 4 two ranks hold history only)
    "helios": ModelCase("helios", dict(image_hw=_hw(16), frames=1, text_len=8, history=False),
                        dict(image_hw=_hw(16), frames=1, text_len=7, history=True)),
    "ltx": ModelCase("ltx", dict(image_hw=(4, 4), frames=1, text_len=8),
                     dict(image_hw=(3, 3), frames=1, text_len=7, per_token_timestep=True)),
    # uneven also with rope_type="split" ([B, H, T, D/2] tables) and a per-token video timestep
    "ltx2": ModelCase("ltx2", dict(image_hw=(4, 4), frames=1, text_len=8, audio_len=8),
                      dict(image_hw=(3, 3), frames=1, text_len=7, audio_len=5, per_token_timestep=True),
                      uneven_overrides=dict(rope_type="split")),
    # the packed [text | video | audio] sequence: 8 + 4 + 4 = 16 and 7 + 9 + 5 = 21
    "minimax_h3": ModelCase("minimax_h3", dict(image_hw=_hw(4), frames=1, text_len=8, audio_len=4),
                            dict(image_hw=_hw(9), frames=1, text_len=7, audio_len=5)),
    "hunyuanvideo": ModelCase("hunyuanvideo", dict(image_hw=_hw(16), frames=1, text_len=9),
                              dict(image_hw=_hw(9), frames=1, text_len=9), pad_text=True),
    # 3 latent frames: at P = 4 the first frame's tokens end inside rank 1's shard
    "hunyuanvideo_i2v": ModelCase("hunyuanvideo", dict(image_hw=_hw(16), frames=3, text_len=9),
                                  dict(image_hw=_hw(9), frames=3, text_len=9),
                                  overrides=dict(image_condition_type="token_replace"), pad_text=True),
    # context = MLLM T + byT5 T/2 + 4 image tokens: 8 + 4 + 4 = 16 and 7 + 3 + 4 = 14
    "hunyuanvideo15": ModelCase("hunyuanvideo15", dict(image_hw=(4, 4), frames=1, text_len=8),
                                dict(image_hw=(3, 3), frames=1, text_len=7)),
    # CogVideoX 1.5: temporal patches of 2 latent frames
    "cogvideox": ModelCase("cogvideox", dict(image_hw=_hw(16), frames=4, text_len=9, ragged_text=False),
                           dict(image_hw=_hw(9), frames=2, text_len=9, ragged_text=False), pad_text=True),
}
# fmt: on

# fmt: off
# The image-conditioned families (tests/test_image_cond_parity.py): the condition joins the sequence (edits: packed
# tokens after the noisy ones) or the channels (Wan I2V; TI2V: per-token timesteps). N noisy + C condition tokens.
COND_MODELS: dict[str, ModelCase] = {
    # 16 + 16 and 9 + 4 tokens
    "qwenimage_edit": ModelCase("qwenimage", dict(image_hw=_hw(16), text_len=8, condition_hw=(_hw(16),)),
                                dict(image_hw=_hw(9), text_len=7, condition_hw=((4, 4),))),
    # Qwen-Image-Edit-2511 (zero_cond_t: the condition tokens modulated at t = 0) with Plus's two images: 16 + 4 + 4
    # and 9 + 4 + 3 tokens
    "qwenimage_edit_plus": ModelCase("qwenimage", dict(image_hw=_hw(16), text_len=8, condition_hw=((4, 4), (4, 4))),
                                     dict(image_hw=_hw(9), text_len=7, condition_hw=((4, 4), (6, 2))),
                                     overrides=dict(zero_cond_t=True)),
    # packed grids: 16 + 16 and 9 + 4 tokens
    "flux_kontext": ModelCase("flux", dict(image_hw=(4, 4), text_len=8, condition_hw=((4, 4),)),
                              dict(image_hw=(3, 3), text_len=7, condition_hw=((2, 2),)),
                              overrides=dict(guidance_embeds=False)),
    # noisy + mask + first frame as channels (4 + 4 + 4), CLIP tokens; the text is 512 rows (WanAttnProcessor)
    "wan_i2v": ModelCase("wan", dict(image_hw=_hw(16), frames=2, text_len=512),
                         dict(image_hw=_hw(9), frames=3, text_len=512),
                         overrides=dict(in_channels=12, out_channels=4, image_dim=16, added_kv_proj_dim=64)),
    "wan_ti2v": ModelCase("wan", dict(image_hw=_hw(16), frames=2, text_len=8, first_frame_timestep=True),
                          dict(image_hw=_hw(9), frames=3, text_len=7, first_frame_timestep=True)),
}
# fmt: on
ALL_MODELS = {**MODELS, **COND_MODELS}


def build(name: str, length: str, seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The tiny model and its (single-process) inputs of case ``name`` at ``length``."""
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    case = ALL_MODELS[name]
    overrides = {**case.overrides, **(case.uneven_overrides if length == "uneven" else {})}
    model = tiny_model(case.kind, seed=seed, **overrides)
    kwargs = dict(case.even if length == "even" else case.uneven)
    return model, tiny_inputs(case.kind, model, batch=2, seed=seed + 1, **kwargs)


def sp_inputs(name: str, length: str, inputs: dict[str, Any], world: int) -> dict[str, Any]:
    """What the SP run gets: the same inputs, with the text padded to the degree (and a key mask over the
    padding) in the even case of the models that take one."""
    case = ALL_MODELS[name]
    if not (case.pad_text and length == "even"):
        return inputs
    from sp_diffusers.parallel.padding import pad_text_batch

    embeds, mask = pad_text_batch(
        inputs["encoder_hidden_states"], inputs.get("encoder_attention_mask"), world
    )
    if case.kind == "hunyuanvideo":
        return {**inputs, "encoder_hidden_states": embeds, "encoder_attention_mask": mask}
    kwargs_name = "joint_attention_kwargs" if case.kind == "sd3" else "attention_kwargs"
    return {**inputs, "encoder_hidden_states": embeds, kwargs_name: {"encoder_hidden_states_mask": mask}}


def outputs(result: Any) -> list[torch.Tensor]:
    """Every tensor a forward returned: the sample, LTX-2's and MiniMax-H3's audio sample, Z-Image's per-sample
    list; from a tuple (``return_dict=False``) or an output dataclass (``return_dict=True``)."""
    if torch.is_tensor(result):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for item in result for t in outputs(item)]
    if hasattr(result, "to_tuple"):
        return outputs(result.to_tuple())
    raise TypeError(f"a model returned {type(result).__name__}, not tensors")
