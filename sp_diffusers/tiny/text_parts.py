"""Tiny random text encoders, tokenizers and VAEs of the real classes the pipelines use (nothing downloaded).

The tokenizers work on characters (a ``tokenizers`` word-level model over printable ASCII), so they need no vocab
files and every prompt has its own ids; the models are the real ``transformers`` / diffusers classes with small
configs and a fixed seed (same seed, same weights). ``save_tiny_clip`` writes a CLIP folder for the CLIP reward.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "char_tokenizer",
    "chat_tokenizer",
    "flux_parts",
    "mistral_chat_tokenizer",
    "require_weights",
    "save_pipeline",
    "save_tiny_clip",
    "tiny_autoencoder_kl",
    "tiny_clip_text",
    "tiny_flux2_vae",
    "tiny_gemma3",
    "tiny_hunyuanvideo15_vae",
    "tiny_ltx2_audio_vae",
    "tiny_ltx2_connectors",
    "tiny_ltx2_vae",
    "tiny_ltx2_vocoder",
    "tiny_mistral3",
    "tiny_qwen3",
    "tiny_qwen25vl",
    "tiny_qwen25vl_text",
    "tiny_qwenimage_vae",
    "tiny_t5",
    "tiny_umt5",
    "tiny_wan_vae",
]

WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)]


def require_weights(writer: str, folders: list[Path]) -> None:
    """Raise unless every model folder just written holds its weights (``*.safetensors``).

    From transformers 5.15, ``save_pretrained`` writes a model's weights only on rank 0 when torch.distributed is
    initialised (``is_main_process=True`` notwithstanding): on any other rank the folder gets its config and no
    weights, and loading it fails later, on that rank only, while its peers wait in a collective."""
    missing = [str(f) for f in folders if not any(f.glob("*.safetensors"))]
    if not missing:
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    why = (
        f"this process is rank {rank} of a process group, and transformers >= 5.15 writes model weights on rank 0 only"
        if rank
        else "save_pretrained wrote no weights"
    )
    raise RuntimeError(
        f"{writer}: no weights written in {', '.join(missing)} ({why}); fix: write the folder once, on one process "
        "(before init_process_group, or on rank 0 followed by a barrier), and give its path to every rank"
    )


def char_tokenizer(max_length: int) -> Any:
    """A ``PreTrainedTokenizerFast``: one token per printable ASCII character, pad 0, bos 1, eos 2, unk 3."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


# A Qwen-style chat template of our own (ChatML markers): what Z-Image's pipeline renders each prompt with
# (``apply_chat_template(..., add_generation_prompt=True, enable_thinking=True)``); ``enable_thinking=False`` adds
# the empty think block, as Qwen3's template does.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
CHAT_WORDS = [*WORDS, "\n"]  # the template's newlines get a token of their own (WORDS: printable ASCII only)


def chat_tokenizer(max_length: int) -> Any:
    """A character tokenizer (as :func:`char_tokenizer`, plus a newline token: ``len(CHAT_WORDS)`` ids) with
    :data:`CHAT_TEMPLATE`, so ``apply_chat_template`` works as with a Qwen3 tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(CHAT_WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# A Mistral-style chat template of our own over content lists (what FLUX.2 [dev]'s pipeline renders: a system turn,
# then the user's text, ``add_generation_prompt=False``); its markers and FLUX.2's system message are one token each.
MISTRAL_TEMPLATE = (
    "{%- for message in messages -%}{%- for part in message['content'] -%}"
    "{%- if message['role'] == 'system' -%}{{ '[SYSTEM_PROMPT]' + part['text'] + '[/SYSTEM_PROMPT]' }}"
    "{%- else -%}{{ '[INST]' + part['text'] + '[/INST]' }}{%- endif -%}"
    "{%- endfor -%}{%- endfor -%}"
)


def mistral_chat_tokenizer(max_length: int, system_message: str) -> Any:
    """A character tokenizer (as :func:`chat_tokenizer`) with :data:`MISTRAL_TEMPLATE`: its four markers and
    ``system_message`` (FLUX.2's ~170 characters) are added tokens, so a templated prompt is a few tokens more than
    the prompt's characters. FLUX.2 [dev] reads it where the released folder holds Mistral's processor (the tokenizer
    is all a text prompt needs, and the processor needs torchvision)."""
    tokenizer = chat_tokenizer(max_length)
    markers = ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]
    tokenizer.add_special_tokens({"additional_special_tokens": [*markers, system_message]})
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


def tiny_mistral3(seed: int, vocab: int, hidden: int = 16, layers: int = 30, max_positions: int = 1024) -> Any:
    """``Mistral3ForConditionalGeneration`` (FLUX.2 [dev]'s text encoder, released: Mistral-Small-3.2-24B) with a
    ``layers``-layer Mistral text model ``hidden`` wide and a one-layer Pixtral vision tower (the class needs one;
    a text prompt never reaches it). The pipeline stacks ``hidden_states`` 10, 20 and 30: with 30 layers the last is
    the final layer's output (the released model has 40)."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    vision = PixtralVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8, image_size=32
    )
    text = MistralConfig(**_decoder_dims(vocab, hidden, layers, max_positions))
    config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=3, spatial_merge_size=1)
    return _seeded(seed, lambda: Mistral3ForConditionalGeneration(config)).eval()


def _decoder_dims(vocab: int, hidden: int, layers: int, max_positions: int) -> dict[str, Any]:
    """A tiny decoder LM's config keys (Qwen3, Mistral): two heads of ``hidden / 2``, one key/value head, an MLP twice
    as wide, the character tokenizers' pad / bos / eos ids."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden // 2,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def tiny_clip_text(seed: int, hidden: int = 16, projection: bool = True, max_positions: int = 77) -> Any:
    """``CLIPTextModelWithProjection`` (SD3) or ``CLIPTextModel`` (Flux: pooled = hidden), ``hidden`` wide."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(WORDS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=hidden,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return _seeded(seed, lambda: cls(config))


def tiny_t5(seed: int, d_model: int = 32, vocab_size: int = 0) -> Any:
    """``T5EncoderModel`` (SD3's and Flux's third / second encoder, HunyuanVideo-1.5's byT5 glyph encoder),
    ``d_model`` wide, over ``vocab_size`` ids (0: :data:`WORDS`)."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size or len(WORDS),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        pad_token_id=0,
        eos_token_id=2,
    )
    return _seeded(seed, lambda: T5EncoderModel(config))


def tiny_umt5(seed: int = 1234, d_model: int = 32, num_layers: int = 2):
    """``(ByT5Tokenizer, UMT5EncoderModel)``: Wan's text-encoder class, tiny and random (same seed, same weights),
    over ByT5's byte vocabulary (a pure-python tokenizer that needs no files, so nothing is downloaded)."""
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    tokenizer = ByT5Tokenizer()
    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=num_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return tokenizer, _seeded(seed, lambda: UMT5EncoderModel(config)).eval()


def qwen25vl(seed: int, hidden: int, vocab: int, max_positions: int, vision: dict | None = None, **ids: int) -> Any:
    """A tiny ``Qwen2_5_VLForConditionalGeneration``: one text layer ``hidden`` wide, one vision block of 4-pixel
    patches merged 2 x 2 (``vision``: more of its config), special token ids ``ids`` beside bos 1, eos 2, pad 0."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads = 2
    half = hidden // heads // 2  # mrope sections cover half a head (t, h, w)
    tokens = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1)
    text.update(num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=max_positions, **tokens)
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    tower = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden, patch_size=4)
    tower.update(spatial_merge_size=2, temporal_patch_size=1, fullatt_block_indexes=[0], window_size=8, **(vision or {}))
    config = Qwen2_5_VLConfig(text_config=text, vision_config=tower, **tokens, **ids)
    return _seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config)).eval()


def tiny_qwen3(
    seed: int, hidden: int = 32, max_positions: int = 1024, layers: int = 2, causal_lm: bool = False
) -> Any:
    """A Qwen3 text encoder, ``hidden`` wide, ``layers`` layers, over :data:`CHAT_WORDS`: ``Qwen3Model`` (Z-Image's
    class: its pipeline reads ``hidden_states[-2]``, so two layers make that a layer's output, not the embeddings),
    or with ``causal_lm`` ``Qwen3ForCausalLM`` (FLUX.2 [klein]'s class: its pipeline stacks ``hidden_states`` 9, 18
    and 27, so it needs at least 27 layers; 28 keep all three intermediate, as in the released 36-layer Qwen3-4B)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(**_decoder_dims(len(CHAT_WORDS), hidden, layers, max_positions))
    cls = Qwen3ForCausalLM if causal_lm else Qwen3Model
    return _seeded(seed, lambda: cls(config)).eval()


def tiny_qwen25vl(seed: int, hidden: int = 32) -> Any:
    """``Qwen2_5_VLForConditionalGeneration`` (Qwen-Image's text encoder), ``hidden`` wide, one text layer."""
    return qwen25vl(seed, hidden, len(WORDS), 2048)


def tiny_qwen25vl_text(seed: int, hidden: int = 32, layers: int = 3, max_positions: int = 2048) -> Any:
    """``Qwen2_5_VLTextModel`` (HunyuanVideo-1.5's MLLM text encoder class) over :data:`CHAT_WORDS`, ``hidden``
    wide, ``layers`` layers: the pipeline reads ``hidden_states[-3]``, so three make that a layer's output."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    heads = 2
    half = hidden // heads // 2  # mrope sections cover half a head (t, h, w)
    config = Qwen2_5_VLTextConfig(
        vocab_size=len(CHAT_WORDS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        rope_scaling={"type": "mrope", "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _seeded(seed, lambda: Qwen2_5_VLTextModel(config)).eval()


def tiny_hunyuanvideo15_vae(seed: int, latent_channels: int) -> Any:
    """``AutoencoderKLHunyuanVideo15`` compressing 2x in space and time (frames ``1 + 2 k`` -> ``1 + k``),
    ``latent_channels`` deep, the released scaling factor (its config has no shift or per-channel statistics)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return _seeded(
        seed,
        lambda: AutoencoderKLHunyuanVideo15(
            latent_channels=latent_channels,
            block_out_channels=(8, 8),
            layers_per_block=1,
            spatial_compression_ratio=2,
            temporal_compression_ratio=2,
        ),
    )


def tiny_gemma3(seed: int, hidden: int = 32, layers: int = 2, max_positions: int = 1024) -> Any:
    """``Gemma3ForConditionalGeneration`` (LTX-2's text encoder class) over :data:`WORDS` (:func:`char_tokenizer`),
    ``hidden`` wide, ``layers`` sliding-window layers and a one-block SigLIP tower (8 x 8 images, 4 tokens each) that
    text-only prompts never reach. LTX-2 stacks all ``layers + 1`` hidden states (embeddings included)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokens = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    text = dict(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers)
    text.update(num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, sliding_window=64, **tokens)
    text["max_position_embeddings"] = max_positions
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8)
    vision["patch_size"] = 4
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, **tokens)
    return _seeded(seed, lambda: Gemma3ForConditionalGeneration(config)).eval()


def tiny_ltx2_connectors(seed: int, caption_channels: int, text_layers: int, registers: int = 8) -> Any:
    """``LTX2TextConnectors`` (LTX-2.0's: one shared projection of the ``text_layers + 1`` stacked Gemma states to
    ``caption_channels``, then a video and an audio 1-layer connector ``caption_channels`` wide (4 heads) with
    ``registers`` learnable registers: the pipeline's ``max_sequence_length`` must be a multiple of ``registers``)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    heads = 4
    return _seeded(
        seed,
        lambda: LTX2TextConnectors(
            caption_channels=caption_channels,
            text_proj_in_factor=text_layers + 1,
            video_connector_num_attention_heads=heads,
            video_connector_attention_head_dim=caption_channels // heads,
            video_connector_num_layers=1,
            video_connector_num_learnable_registers=registers,
            audio_connector_num_attention_heads=heads,
            audio_connector_attention_head_dim=caption_channels // heads,
            audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=registers,
            connector_rope_base_seq_len=64,
            rope_type="interleaved",
        ),
    )


def tiny_ltx2_vae(seed: int, latent_channels: int) -> Any:
    """``AutoencoderKLLTX2Video`` compressing 2x in space and in time, causally (frames ``1 + 2 k`` -> ``1 + k``,
    16 x 16 pixels -> 8 x 8), ``latent_channels`` deep, per-channel latent statistics away from 0 / 1 (the pipeline
    normalises with them), no timestep conditioning (as LTX-2.0's VAE)."""
    from diffusers import AutoencoderKLLTX2Video

    def build() -> Any:
        vae = AutoencoderKLLTX2Video(
            latent_channels=latent_channels,
            block_out_channels=(8,),
            decoder_block_out_channels=(8,),
            layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False),
            downsample_type=("spatiotemporal",),
            upsample_type=("spatiotemporal",),
            upsample_residual=(True,),
            upsample_factor=(2,),
            timestep_conditioning=False,
            patch_size=1,
            patch_size_t=1,
        )
        return _with_stat_buffers(vae)

    return _seeded(seed, build)


def tiny_ltx2_audio_vae(seed: int, latent_channels: int = 2, mel_bins: int = 16) -> Any:
    """``AutoencoderKLLTX2Audio`` over stereo ``mel_bins``-bin mel spectrograms at LTX-2's 16 kHz / hop 160 (100 mel
    frames a second), compressing 4x in time (causal: ``T`` mel frames -> ``(T - 1) // 4 + 1`` latents; decoding
    ``L`` latents gives ``4 L - 3`` frames) and 4x in mel bins (three levels, as released), ``latent_channels`` deep.
    Its latent statistics have one entry per packed audio feature (``base_channels`` = ``latent_channels *
    mel_bins / 4``: the transformer's ``audio_in_channels``), set away from 0 / 1."""
    from diffusers import AutoencoderKLLTX2Audio

    features = latent_channels * mel_bins // 4

    def build() -> Any:
        vae = AutoencoderKLLTX2Audio(
            base_channels=features,
            output_channels=2,
            ch_mult=(1, 1, 1),
            num_res_blocks=1,
            in_channels=2,
            resolution=mel_bins,
            latent_channels=latent_channels,
            sample_rate=16000,
            mel_hop_length=160,
            mel_bins=mel_bins,
        )
        return _with_stat_buffers(vae)

    return _seeded(seed, build)


def tiny_ltx2_vocoder(seed: int, audio_vae: Any) -> Any:
    """``LTX2Vocoder`` (LTX-2.0's) turning ``audio_vae``'s stereo mel frames into a stereo waveform: 16 samples a mel
    frame (released: 240 at 24 kHz), so ``output_sampling_rate`` = 100 mel frames a second x 16 = 1600 Hz."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    cfg = audio_vae.config
    factors = [4, 4]
    rate = cfg.sample_rate // cfg.mel_hop_length * factors[0] * factors[1]
    return _seeded(
        seed,
        lambda: LTX2Vocoder(
            in_channels=cfg.output_channels * cfg.mel_bins,
            hidden_channels=16,
            out_channels=cfg.output_channels,
            upsample_kernel_sizes=[8, 8],
            upsample_factors=factors,
            resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3]],
            output_sampling_rate=rate,
        ),
    )


def save_tiny_clip(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Write a tiny random ``CLIPModel`` (32 x 32 images), its character tokenizer and a ``preprocessor_config.json``
    to ``folder``: what ``sp_diffusers.flowgrpo.rewards.clip`` reads from a downloaded CLIP."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(WORDS),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )
    folder = Path(folder)
    _seeded(seed, lambda: CLIPModel(config)).save_pretrained(folder)
    require_weights("save_tiny_clip", [folder])
    char_tokenizer(32).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {"crop_size": {"height": 32, "width": 32}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25] * 3}
        )
    )
    return folder
def tiny_autoencoder_kl(seed: int, latent_channels: int, scaling: float, shift: float, factor: int = 2) -> Any:
    """``AutoencoderKL`` (SD3's and FLUX.1's VAE class), ``latent_channels``, compressing ``factor`` (2, or 8 with
    four blocks as the released one) spatially."""
    from diffusers import AutoencoderKL

    blocks, width, groups, size = (2, 8, 4, 16) if factor == 2 else (4, 4, 2, 64)
    return _seeded(
        seed,
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=latent_channels,
            down_block_types=("DownEncoderBlock2D",) * blocks,
            up_block_types=("UpDecoderBlock2D",) * blocks,
            block_out_channels=(width,) * blocks,
            layers_per_block=1,
            norm_num_groups=groups,
            sample_size=size,
            scaling_factor=scaling,
            shift_factor=shift,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
    )


def tiny_flux2_vae(seed: int, latent_channels: int) -> Any:
    """``AutoencoderKLFlux2`` (FLUX.2's VAE) compressing 2x spatially, ``latent_channels`` (the pipeline packs each
    2 x 2 patch into one token of 4 x as many channels). Its batch-norm statistics (over those patched channels: what
    the FLUX.2 pipelines normalise latents with) are set away from 0 / 1, so a trainer that skips or misorders them is
    caught."""
    from diffusers import AutoencoderKLFlux2

    def build() -> Any:
        vae = AutoencoderKLFlux2(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 8),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=4,
            sample_size=16,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        n = vae.bn.num_features
        with torch.no_grad():
            vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.4, n))
            vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, n))
        return vae

    return _seeded(seed, build)


def _with_stat_buffers(vae: Any) -> Any:
    """``vae`` with its ``latents_mean`` / ``latents_std`` buffers (LTX-2's VAEs keep them as buffers, not config)
    set to :func:`_latent_stats`, away from 0 / 1."""
    stats = _latent_stats(vae.latents_mean.numel())
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor(stats["latents_mean"]))
        vae.latents_std.copy_(torch.tensor(stats["latents_std"]))
    return vae


def _latent_stats(z_dim: int) -> dict[str, list[float]]:
    return {"latents_mean": [0.1 * i for i in range(z_dim)], "latents_std": [1.0 + 0.1 * i for i in range(z_dim)]}


def tiny_qwenimage_vae(seed: int, z_dim: int, factor: int = 2) -> Any:
    """``AutoencoderKLQwenImage`` compressing ``factor`` (2: one down block; 8: three, as the released one) spatially,
    ``z_dim`` channels."""
    from diffusers import AutoencoderKLQwenImage

    downs = {2: 1, 8: 3}[factor]
    return _seeded(
        seed,
        lambda: AutoencoderKLQwenImage(
            base_dim=8 if factor == 2 else 4,
            z_dim=z_dim,
            dim_mult=[1] * (downs + 1),
            num_res_blocks=1,
            temperal_downsample=[False] * downs,
            **_latent_stats(z_dim),
        ),
    )


def tiny_wan_vae(seed: int, z_dim: int, factor: int = 2) -> Any:
    """``AutoencoderKLWan`` compressing ``factor`` (2 or 4) in space and in time, ``z_dim`` channels. At 4 its
    encoder takes a first frame and then chunks of 4 frames, as an image-to-video condition (the first frame and
    zeros) needs."""
    from diffusers import AutoencoderKLWan

    downs = {2: 1, 4: 2}[factor]
    return _seeded(
        seed,
        lambda: AutoencoderKLWan(
            base_dim=8,
            z_dim=z_dim,
            dim_mult=[1] * (downs + 1),
            num_res_blocks=1,
            temperal_downsample=[True] * downs,
            **_latent_stats(z_dim),
            scale_factor_temporal=factor,
            scale_factor_spatial=factor,
        ),
    )


def save_pipeline(pipe: Any, folder: str | os.PathLike) -> Path:
    """``pipe`` written to ``folder`` by ``save_pretrained``, refused where a model's weights were not written."""
    import torch

    pipe.save_pretrained(folder)
    models = [Path(folder) / name for name, part in pipe.components.items() if isinstance(part, torch.nn.Module)]
    require_weights(f"save_tiny_pipeline ({type(pipe).__name__})", models)
    return Path(folder)


def flux_parts(seed: int, transformer: Any, vae_factor: int = 2) -> dict[str, Any]:
    """FLUX.1's components around ``transformer``: its scheduler config, an ``AutoencoderKL`` with Flux's scaling and
    shift compressing ``vae_factor`` (latent channels = in_channels / 4), CLIP (pooled) and T5 with character
    tokenizers."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ..families.scheduler_configs import scheduler_kwargs

    cfg = transformer.config
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("flux")),
        vae=tiny_autoencoder_kl(seed + 3, cfg.in_channels // 4, 0.3611, 0.1159, factor=vae_factor),
        text_encoder=tiny_clip_text(seed + 1, cfg.pooled_projection_dim, projection=False),
        tokenizer=char_tokenizer(77),
        text_encoder_2=tiny_t5(seed + 2, cfg.joint_attention_dim),
        tokenizer_2=char_tokenizer(512),
    )
