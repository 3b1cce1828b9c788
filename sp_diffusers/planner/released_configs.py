"""The transformer configs of released checkpoints that several built-ins share (each repository's
``transformer/config.json``, the keys that size the model)."""

from __future__ import annotations

from typing import Any

__all__ = ["FLUX2_DEV", "FLUX2_KLEIN_4B", "FLUX_DEV", "QWEN_IMAGE", "QWEN_IMAGE_2512", "WAN_14B", "Z_IMAGE_TURBO"]

WAN_14B: dict[str, Any] = {  # Wan-AI/Wan2.1-T2V-14B-Diffusers
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "added_kv_proj_dim": None,
}

QWEN_IMAGE: dict[str, Any] = {  # Qwen/Qwen-Image
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}
# Qwen/Qwen-Image-2512: a new release of Qwen-Image's weights; its published transformer config is Qwen-Image's
# (tests/test_qwen_image_2512.py builds the model from it at the published size)
QWEN_IMAGE_2512: dict[str, Any] = QWEN_IMAGE
FLUX_DEV: dict[str, Any] = {  # black-forest-labs/FLUX.1-dev
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}

Z_IMAGE_TURBO: dict[str, Any] = {  # Tongyi-MAI/Z-Image-Turbo (S3-DiT, 6B; text: Qwen3-4B's 2560-wide states)
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 2560,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": (32, 48, 48),
    "axes_lens": (1536, 512, 512),
}

# FLUX.2: diffusers' scripts/convert_flux2_to_diffusers.py (get_flux2_transformer_config), which writes the released
# transformer/config.json of each; in_channels = 4 x AutoencoderKLFlux2's 32 latent channels (2 x 2 packing),
# joint_attention_dim = 3 stacked text-encoder layers side by side.
FLUX2_KLEIN_4B: dict[str, Any] = {  # black-forest-labs/FLUX.2-klein-4B (and -base-4B): Qwen3-4B text, 3 x 2560
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 20,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": (32, 32, 32, 32),
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": False,
}

FLUX2_DEV: dict[str, Any] = {  # black-forest-labs/FLUX.2-dev: Mistral-Small-3.2-24B text, 3 x 5120; guidance-distilled
    **FLUX2_KLEIN_4B,
    "num_layers": 8,
    "num_single_layers": 48,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,
    "guidance_embeds": True,
}
