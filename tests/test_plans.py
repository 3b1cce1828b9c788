"""sp_diffusers' context-parallel plans, single process: the processors they swap in compute diffusers' own
function when no parallelism is set (forward and every parameter gradient), padded text + key mask equals
the unpadded model, the joint-mask reordering is the all-to-all's key order, and bad inputs name the fix.

Multi-process parity of the plans (SP = 2 and 4, every diffusers version) is in ``test_model_parity.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

# Reordering the layout around SDPA ([B, S, H, D] through the dispatcher vs diffusers' [B, H, S, D]) may
# change fp32 rounding in the last bit; measured 0 (outputs) and ~1e-10 (gradients).
TOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def installed():
    import sp_diffusers

    report = sp_diffusers.install()
    yield report
    sp_diffusers.uninstall()


def _run(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and every parameter gradient of ``sum(out * w)`` for a fixed random ``w``."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, return_dict=False)[0]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weight).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(a: tuple, b: tuple, tol: float, what: str) -> None:
    out_a, grads_a = a
    out_b, grads_b = b
    assert grads_a.keys() == grads_b.keys(), f"{what}: different parameters received gradients"
    assert (out_a - out_b).abs().max().item() <= tol * max(1.0, out_b.abs().max().item()), f"{what}: output"
    for name, g in grads_a.items():
        err = (g - grads_b[name]).abs().max().item()
        assert err <= tol * max(1.0, grads_b[name].abs().max().item()), (
            f"{what}: grad of {name} off by {err:.3e}"
        )


def _processors(model: torch.nn.Module) -> set[str]:
    return {type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")}


def _prepared(model: torch.nn.Module) -> torch.nn.Module:
    from sp_diffusers.patching import plans

    prepared = copy.deepcopy(model)
    plans.prepare_model(prepared)
    return prepared


def test_plans_are_attached(installed):
    from diffusers import CogVideoXTransformer3DModel, HunyuanVideoTransformer3DModel

    statuses = {p.model_class: p for p in installed.plans}
    for cls in (HunyuanVideoTransformer3DModel, CogVideoXTransformer3DModel):
        assert statuses[cls.__name__].attached, statuses[cls.__name__]
        assert "proj_out" in cls._cp_plan and "transformer_blocks.0" in cls._cp_plan


@pytest.mark.parametrize("variant", [{}, {"image_condition_type": "token_replace"}], ids=["t2v", "i2v"])
def test_hunyuanvideo_processor_is_diffusers_bit_for_bit(variant):
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    model = tiny_model("hunyuanvideo", **variant)
    prepared = _prepared(model)
    assert _processors(prepared) == {
        "HunyuanVideoJointAttnProcessor",
        "AttnProcessor2_0",
    }  # refiner stays local
    inputs = tiny_inputs("hunyuanvideo", model, text_len=9, frames=3)  # ragged text mask
    _assert_close(_run(prepared, inputs), _run(model, inputs), 0.0, "HunyuanVideo")


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # CogVideoX-2b style: sincos positions added by the patch embedding (text fixed at its max length),
        # Conv2d patches, no RoPE
        dict(
            use_rotary_positional_embeddings=False,
            patch_size_t=None,
            max_text_seq_length=8,
            sample_frames=5,
        ),
    ],
    ids=["rope_1.5", "sincos_1.0"],
)
def test_cogvideox_processor_matches_diffusers(overrides):
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    model = tiny_model("cogvideox", **overrides)
    prepared = _prepared(model)
    assert _processors(prepared) == {"CogVideoXJointAttnProcessor"}
    frames = 2 if overrides else 4  # sincos: (5 - 1) / 4 + 1 = 2 latent frames, as in the config
    inputs = tiny_inputs("cogvideox", model, text_len=8, frames=frames, ragged_text=False)
    _assert_close(_run(prepared, inputs), _run(model, inputs), TOL, "CogVideoX")


def test_cogvideox_padded_text_with_key_mask_equals_unpadded():
    from sp_diffusers.parallel.padding import pad_text_batch
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    model = tiny_model("cogvideox")
    prepared = _prepared(model)
    inputs = tiny_inputs("cogvideox", model, text_len=9, frames=4, ragged_text=False)
    embeds, mask = pad_text_batch(inputs["encoder_hidden_states"], None, 4)
    padded = {
        **inputs,
        "encoder_hidden_states": embeds,
        "attention_kwargs": {"encoder_hidden_states_mask": mask},
    }
    assert embeds.shape[1] == 12
    _assert_close(_run(prepared, padded), _run(model, inputs), TOL, "CogVideoX padded")
    # the mask matters: without it the padded keys change the result
    unmasked = {**padded, "attention_kwargs": None}
    assert (_run(prepared, unmasked)[0] - _run(model, inputs)[0]).abs().max() > 1e-3


def test_joint_masks_are_in_all_to_all_key_order():
    from sp_diffusers.patching.plans import HunyuanVideoJointAttnProcessor
    from sp_diffusers.patching.plans._joint import text_key_mask, to_all_to_all_order

    # 2 ranks, 3 video + 2 text tokens each: global [v0 v1 v2 v3 v4 v5 t0 t1 t2 t3]
    keys = torch.arange(10)
    assert to_all_to_all_order(keys, 0, [3, 3], [2, 2]).tolist() == [0, 1, 2, 6, 7, 3, 4, 5, 8, 9]
    # uneven shards: rank 0 holds 3 video + 1 text token, rank 1 holds 2 + 2 (global [v0..v4 t0..t2])
    assert to_all_to_all_order(torch.arange(8), 0, [3, 2], [1, 2]).tolist() == [0, 1, 2, 5, 3, 4, 6, 7]
    square = torch.arange(100).reshape(1, 1, 10, 10)
    reordered = HunyuanVideoJointAttnProcessor._in_all_to_all_order(square, [3, 3], [2, 2], 0)
    order = [0, 1, 2, 6, 7, 3, 4, 5, 8, 9]
    assert torch.equal(reordered[0, 0], square[0, 0][order][:, order])
    local = torch.ones(1, 1, 1, 5, dtype=torch.bool)  # this rank's keys: the backend gathers them
    assert HunyuanVideoJointAttnProcessor._in_all_to_all_order(local, [3, 3], [2, 2], 1) is local

    # CogVideoX: text first per rank; [B, T] text mask -> [B, 1, 1, keys]
    text = torch.tensor([[True, True, True, False]])
    mask = text_key_mask(text, [2, 2], [3, 3], True, "test")
    assert mask.shape == (1, 1, 1, 10)
    assert mask[0, 0, 0].tolist() == [True, True, True, True, True, True, False, True, True, True]


def test_bad_masks_name_the_fix():
    from sp_diffusers.patching.plans import CogVideoXJointAttnProcessor, HunyuanVideoJointAttnProcessor
    from sp_diffusers.patching.plans._joint import text_key_mask

    with pytest.raises(ValueError, match="encoder_attention_mask"):
        HunyuanVideoJointAttnProcessor._in_all_to_all_order(
            torch.ones(1, 1, 1, 7, dtype=torch.bool), [3, 3], [2, 2], 0
        )
    with pytest.raises(ValueError, match=r"\[B, T\] over the global \(padded\) text length 4"):
        text_key_mask(torch.ones(1, 3, dtype=torch.bool), [2, 2], [3, 3], True, "CogVideoXJointAttnProcessor")

    from sp_diffusers.tiny import tiny_model

    model = tiny_model("cogvideox")
    attn = model.transformer_blocks[0].attn1
    x, text = torch.randn(1, 4, 64), torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="encoder_hidden_states_mask"):
        CogVideoXJointAttnProcessor()(
            attn,
            x,
            text,
            attention_mask=torch.ones(1, 6),
            encoder_hidden_states_mask=torch.ones(1, 2, dtype=torch.bool),
        )


def test_hunyuanvideo_without_dual_stream_blocks_splits_at_the_first_single_block():
    from sp_diffusers.tiny import tiny_model

    model = tiny_model("hunyuanvideo", num_layers=0, num_single_layers=1)
    prepared = _prepared(model)
    assert "single_transformer_blocks.0" in prepared._cp_plan
    assert "transformer_blocks.0" not in prepared._cp_plan
