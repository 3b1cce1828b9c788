"""The transformer configs of released checkpoints that several built-ins share (each repository's
``transformer/config.json``, the keys that size the model)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "FLUX2_DEV",
    "FLUX2_KLEIN_4B",
    "FLUX_DEV",
    "LTX_2",
    "QWEN_IMAGE",
    "QWEN_IMAGE_2512",
    "WAN_14B",
    "Z_IMAGE_TURBO",
]

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

# LTX-2: diffusers' scripts/convert_ltx2_to_diffusers.py (get_ltx2_transformer_config, version "2.0", model_id
# Lightricks/LTX-2), which writes the released transformer/config.json. Video 32 x 128 heads (4096 wide), audio
# 32 x 64 (2048 wide), 48 blocks of both; caption_channels = Gemma 3's 3840-wide states out of the pipeline's
# connectors, one stream each; audio_sampling_rate / audio_hop_length / audio_scale_factor = 16000 / 160 / 4 = 25
# audio latents a second (the audio VAE's).
LTX_2: dict[str, Any] = {  # Lightricks/LTX-2 (19B audio-video)
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "vae_scale_factors": (8, 32, 32),
    "pos_embed_max_pos": 20,
    "base_height": 2048,
    "base_width": 2048,
    "gated_attn": False,
    "cross_attn_mod": False,
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_patch_size": 1,
    "audio_patch_size_t": 1,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4,
    "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "audio_gated_attn": False,
    "audio_cross_attn_mod": False,
    "num_layers": 48,
    "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "caption_channels": 3840,
    "attention_bias": True,
    "attention_out_bias": True,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_offset": 1,
    "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000,
    "rope_type": "split",
    "use_prompt_embeddings": True,
    "perturbed_attn": False,
}
