"""Prompt encoders: the embedded defaults (tiny, random ``transformers`` models over bytes) and a diffusers
pipeline's own text encoders (``PipelineTextEncoder``, for real checkpoints).

Real pipelines encode prompts with a large text model (Qwen2.5-VL for Qwen-Image, UMT5-XXL for Wan); the
embedded defaults keep the same shape of data with no download, with a fixed seed (identical on every rank),
frozen:

- ``ByteTextEncoder``: UTF-8 byte ids through a tiny Qwen2 stack, so prompts of different lengths give ragged
  embeddings and masks that the engine must pad;
- ``UMT5TextEncoder``: Wan's own encoder class (``UMT5EncoderModel``, tiny) over ByT5's byte tokenizer, used the
  way ``WanPipeline`` uses it: tokenised to ``max_sequence_length``, each prompt's states cut at its length and
  zero-padded back (Wan's transformer sees every row, so the masks are all True).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import torch

__all__ = ["DEFAULT_PROMPTS", "ByteTextEncoder", "PipelineTextEncoder", "UMT5TextEncoder"]

COLORS = ("red", "green", "blue", "yellow")
OBJECTS = ("cat", "house", "bicycle", "mountain lake", "teapot", "lighthouse at dusk")
DEFAULT_PROMPTS = tuple(f"a {color} {obj}" for color in COLORS for obj in OBJECTS)

_PAD, _BOS, _EOS = 256, 257, 258


def warn_truncated(encoder: str, prompt: str, length: int, limit: int, what: str) -> None:
    """Say once (rank 0) that a prompt is cut: two prompts that differ only past the limit get one embedding."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
    warnings.warn(
        f"{encoder}: the prompt {shown!r} has {length} tokens, more than {what} ({limit}); the tokens past "
        f"{limit} are dropped (prompts that differ only there get the same embedding). Shorten the prompt, or "
        f"use a real text encoder (text.pipeline: a pipeline folder)",
        UserWarning,
        stacklevel=3,
    )


class ByteTextEncoder(torch.nn.Module):
    """``encode(prompts) -> (list of [L_i, D] embeddings, list of [L_i] bool masks)``, ragged."""

    def __init__(
        self,
        hidden_size: int = 32,
        num_layers: int = 1,
        num_heads: int = 2,
        seed: int = 1234,
        max_length: int = 64,
    ) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2Model

        config = Qwen2Config(
            vocab_size=260,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=1,
            max_position_embeddings=max_length + 2,
            pad_token_id=_PAD,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = Qwen2Model(config)
        self.model.requires_grad_(False)
        self.model.eval()
        self.max_length = max_length
        self.hidden_size = hidden_size

    def tokenize(self, prompts: list[str]) -> list[torch.Tensor]:
        ids = []
        for p in prompts:
            raw = list(p.encode("utf-8"))
            if len(raw) > self.max_length:
                warn_truncated("ByteTextEncoder", p, len(raw), self.max_length, "its limit in UTF-8 bytes")
            raw = raw[: self.max_length]
            ids.append(torch.tensor([_BOS, *raw, _EOS], dtype=torch.long))
        return ids

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ids = self.tokenize(prompts)
        longest = max(len(t) for t in ids)
        batch = torch.full((len(ids), longest), _PAD, dtype=torch.long)
        mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for i, t in enumerate(ids):
            batch[i, : len(t)] = t
            mask[i, : len(t)] = 1
        hidden = self.model(input_ids=batch, attention_mask=mask).last_hidden_state
        # unit scale per token: the tiny transformer's raw states are tiny, the denoiser expects O(1)
        hidden = hidden / hidden.std(dim=-1, keepdim=True).clamp_min(1e-6)
        embeds = [hidden[i, : len(t)].float() for i, t in enumerate(ids)]
        masks = [torch.ones(len(t), dtype=torch.bool) for t in ids]
        return embeds, masks

    def offload(self) -> None:
        """Nothing to move: the built-in encoders run on the CPU."""

    def encode_batch(self, prompts: list[str], prefix: str = "") -> dict[str, Any]:
        """``{prefix}prompt_embeds`` / ``{prefix}prompt_embeds_mask`` (ragged lists) for a trainer batch."""
        embeds, masks = self.encode(prompts)
        return {f"{prefix}prompt_embeds": embeds, f"{prefix}prompt_embeds_mask": masks}


class UMT5TextEncoder:
    """``encode_batch(prompts)``: ``[L, D]`` embeddings per prompt, zero past its tokens, L = ``max_sequence_length``."""

    def __init__(
        self, hidden_size: int = 32, num_layers: int = 2, seed: int = 1234, max_sequence_length: int = 32
    ) -> None:
        from ...tiny.pipelines import tiny_umt5

        self.tokenizer, self.model = tiny_umt5(seed=seed, d_model=hidden_size, num_layers=num_layers)
        self.model.requires_grad_(False)
        self.hidden_size = hidden_size
        self.max_sequence_length = max_sequence_length

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        """``[B, L, D]``, as ``WanPipeline._get_t5_prompt_embeds`` computes it (without its text cleaning)."""
        tok = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        lengths = tok.attention_mask.gt(0).sum(dim=1)
        for p in prompts:
            n = len(self.tokenizer(p, add_special_tokens=True).input_ids)
            if n > self.max_sequence_length:
                warn_truncated("UMT5TextEncoder", p, n, self.max_sequence_length, "text.max_sequence_length")
        hidden = self.model(tok.input_ids, tok.attention_mask).last_hidden_state.float()
        keep = torch.arange(hidden.shape[1])[None, :] < lengths[:, None]
        return hidden * keep[..., None]

    offload = ByteTextEncoder.offload

    def encode_batch(self, prompts: list[str], prefix: str = "") -> dict[str, Any]:
        embeds = self.encode(prompts)
        return {
            f"{prefix}prompt_embeds": list(embeds),
            f"{prefix}prompt_embeds_mask": [torch.ones(embeds.shape[1], dtype=torch.bool)] * len(prompts),
        }


class PipelineTextEncoder:
    """A diffusers pipeline's own text encoders (``text.pipeline`` or ``model.pipeline``: a pipeline folder).

    Loads the pipeline without its transformer and VAE and calls its ``encode_prompt``, so prompts are
    encoded exactly as at inference: for ``StableDiffusion3Pipeline`` CLIP-L + CLIP-G (pooled, and
    hidden states padded to T5's width) followed by T5 (``max_sequence_length`` tokens); for ``WanPipeline``
    UMT5, cut at each prompt's length and zero-padded to ``max_sequence_length``; for ``FluxPipeline`` CLIP (pooled)
    and T5 (``max_sequence_length`` tokens). Those transformers attend to every text token, padding included, so the
    masks are all True. ``QwenImagePipeline``: Qwen2.5-VL's last hidden states after the template, ragged, with a
    mask (its transformer masks the padding). ``ZImagePipeline``: Qwen3's second-to-last hidden states of the
    chat-templated prompt (``enable_thinking=True``) tokenised to ``max_sequence_length``, each prompt's valid tokens
    (ragged, with a mask: the adapter cuts the rows back to it). ``Flux2KleinPipeline``: Qwen3's hidden states 9, 18
    and 27 of the chat-templated prompt (``enable_thinking=False``) padded to ``max_sequence_length``, stacked per
    token (3 x the encoder's width); its transformer attends to every row, padding included (masks all True).
    ``Flux2Pipeline`` (FLUX.2 [dev]): the same with Mistral3's hidden states 10, 20 and 30 of the prompt after the
    pipeline's system message (Mistral's processor needs torchvision: without it, its tokenizer is read alone).
    ``HunyuanVideo15Pipeline``: two streams, each prompt's valid rows with a mask (its transformer masks the rest):
    Qwen2.5-VL's third-to-last hidden states of the system-templated prompt (``prompt_embeds``, up to the pipeline's
    1000 tokens) and the byT5 states of the prompt's quoted text (``prompt_embeds_2``, up to 256; a prompt without
    quoted text: one masked zero row, as the pipeline's all-masked zeros). ``LTX2Pipeline``: Gemma's stacked hidden
    states (left-padded to ``max_sequence_length``) through the pipeline's ``connectors``: a video stream
    (``prompt_embeds``) and an audio stream (``prompt_embeds_2``) over one mask, every row as the pipeline hands them
    (with learnable registers the connectors fill the padding: the mask is all True). Frozen, no gradients.

    The editing and image-to-video pipelines (``CONDITIONED``) keep their VAE (and Wan2.1 I2V its CLIP image encoder):
    the family's adapter prepares the condition with them (``conditioning.py``); Qwen-Image-Edit's prompts are read
    with their image (``encode_batch(..., images=...)``).
    """

    # the image-conditioned pipelines encode text as their text-to-image family does (Qwen-Image-Edit: with the image)
    CONDITIONED: ClassVar[dict[str, str]] = {
        "QwenImageEditPipeline": "QwenImagePipeline",
        "QwenImageEditPlusPipeline": "QwenImagePipeline",
        "FluxKontextPipeline": "FluxPipeline",
        "WanImageToVideoPipeline": "WanPipeline",
    }
    SUPPORTED = (
        "StableDiffusion3Pipeline",
        "WanPipeline",
        "QwenImagePipeline",
        "FluxPipeline",
        "ZImagePipeline",
        "Flux2KleinPipeline",
        "Flux2Pipeline",
        "HunyuanVideo15Pipeline",
        "LTX2Pipeline",
        *CONDITIONED,
    )

    def __init__(
        self,
        path: str,
        max_sequence_length: int = 256,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        import json
        from pathlib import Path

        index = Path(path) / "model_index.json"
        if not index.exists():
            raise FileNotFoundError(
                f"text.pipeline={path!r} has no model_index.json; fix: point it at a diffusers pipeline folder "
                "(save_pretrained / a downloaded stable-diffusion-3.5 repo), or leave it empty for the built-in "
                "byte-level encoder"
            )
        name = json.loads(index.read_text()).get("_class_name")
        self.pipeline_class = name
        self.text_family = self.CONDITIONED.get(name, name)  # whose encode_prompt branch below applies
        if name not in self.SUPPORTED:
            raise ValueError(
                f"text.pipeline={path!r} is a {name}; supported: {', '.join(self.SUPPORTED)} "
                "(its encode_prompt is called); fix: use such a pipeline or the built-in encoder (text.pipeline='')"
            )
        from diffusers import DiffusionPipeline

        kwargs: dict[str, Any] = {}
        if dtype != torch.float32:
            kwargs["torch_dtype"] = dtype  # newer diffusers also take `dtype`; every supported one takes this
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            if name in ("WanPipeline", "WanImageToVideoPipeline") and "transformer_2" in json.loads(index.read_text()):
                kwargs["transformer_2"] = None
            # the conditioned pipelines encode their condition images with it; HunyuanVideo15Pipeline's __init__
            # reads its config (dropped once loaded)
            if name not in self.CONDITIONED and name != "HunyuanVideo15Pipeline":
                kwargs["vae"] = None
            if name == "LTX2Pipeline":  # its audio decoders are not read here either
                kwargs.update(audio_vae=None, vocoder=None)
            if name.startswith("QwenImageEdit"):
                from ...families.processors import load_qwen_vl_processor

                kwargs["processor"] = load_qwen_vl_processor(Path(path) / "processor")
            from ...families.processors import processor_tokenizer

            tokenizer = processor_tokenizer(path)  # FLUX.2 [dev]: Mistral's processor needs torchvision
            if tokenizer is not None:
                kwargs["tokenizer"] = None
            self.pipe = DiffusionPipeline.from_pretrained(path, transformer=None, **kwargs)
            if tokenizer is not None:
                self.pipe.tokenizer = tokenizer
        self.pipe.set_progress_bar_config(disable=True)
        if name == "HunyuanVideo15Pipeline":
            self.pipe.vae = None  # encode_prompt does not read it
        self.device = torch.device(device)
        for component in ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "vae", "connectors"):
            module = getattr(self.pipe, component, None)
            if module is not None:
                module.to(self.device).requires_grad_(False).eval()
        self.max_sequence_length = max_sequence_length

    def offload(self) -> None:
        """The text encoders to the CPU (``text.offload: after_cache``: every prompt of the run is encoded)."""
        self.device = torch.device("cpu")
        for component in ("text_encoder", "text_encoder_2", "text_encoder_3", "connectors"):
            module = getattr(self.pipe, component, None)
            if module is not None:
                module.to(self.device)

    @property
    def hidden_size(self) -> int:
        """The width of the embeddings the transformer receives."""
        if self.text_family in ("QwenImagePipeline", "ZImagePipeline", "HunyuanVideo15Pipeline"):
            config = self.pipe.text_encoder.config
            return int(getattr(config, "text_config", config).hidden_size)
        if self.text_family in ("Flux2KleinPipeline", "Flux2Pipeline"):  # the stacked layers' widths side by side
            config = self.pipe.text_encoder.config
            return len(self._flux2_layers()) * int(getattr(config, "text_config", config).hidden_size)
        if self.text_family == "LTX2Pipeline":  # the connectors' video stream
            c = self.pipe.connectors.config
            if c.per_modality_projections:
                return int(c.video_hidden_dim)
            return int(c.video_connector_num_attention_heads * c.video_connector_attention_head_dim)
        encoder = {"WanPipeline": "text_encoder", "FluxPipeline": "text_encoder_2"}.get(self.text_family, "text_encoder_3")
        return int(getattr(self.pipe, encoder).config.d_model)

    def _dense(self, prefix: str, embeds: torch.Tensor, pooled: torch.Tensor | None = None) -> dict[str, Any]:
        """Every row of every prompt seen (masks all True), as the maskless transformers see the padding."""
        embeds = embeds.float().cpu()
        out = {
            f"{prefix}prompt_embeds": list(embeds),
            f"{prefix}prompt_embeds_mask": [torch.ones(embeds.shape[1], dtype=torch.bool)] * embeds.shape[0],
        }
        if pooled is not None:
            out[f"{prefix}pooled_prompt_embeds"] = pooled.float().cpu()
        return out

    @torch.no_grad()
    def encode_batch(self, prompts: list[str], prefix: str = "", images: list[Any] | None = None) -> dict[str, Any]:
        """``{prefix}prompt_embeds`` (list of ``[L, D]``), ``..._mask`` (all True), ``{prefix}pooled_prompt_embeds``
        ``[B, P]`` (SD3 only): what the pipeline's ``__call__`` passes its transformer. ``images``: each prompt's
        image(s) as the pipeline hands them to ``encode_prompt`` (Qwen-Image-Edit reads the prompt with them)."""
        if images is not None and self.pipeline_class.startswith("QwenImageEdit"):
            # one prompt at a time, as the pipeline encodes it: each with its own image(s)
            parts = [self._qwen(prompt, image) for prompt, image in zip(prompts, images, strict=True)]
            return {
                f"{prefix}prompt_embeds": [e for p in parts for e in p[0]],
                f"{prefix}prompt_embeds_mask": [m for p in parts for m in p[1]],
            }
        if self.text_family == "WanPipeline":
            embeds, _ = self.pipe.encode_prompt(
                prompt=prompts,
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
                device=self.device,
            )
            return self._dense(prefix, embeds)
        if self.text_family == "QwenImagePipeline":
            embeds, masks = self._qwen(prompts)
            return {f"{prefix}prompt_embeds": embeds, f"{prefix}prompt_embeds_mask": masks}
        if self.text_family == "ZImagePipeline":
            embeds = self._zimage(prompts)
            return {
                f"{prefix}prompt_embeds": embeds,
                f"{prefix}prompt_embeds_mask": [torch.ones(e.shape[0], dtype=torch.bool) for e in embeds],
            }
        if self.text_family in ("Flux2KleinPipeline", "Flux2Pipeline"):
            return self._dense(prefix, self._flux2(prompts))
        if self.text_family == "HunyuanVideo15Pipeline":
            return self._hunyuan15(prompts, prefix)
        if self.text_family == "LTX2Pipeline":
            return self._ltx2(prompts, prefix)
        if self.text_family == "FluxPipeline":
            # CLIP pooled + T5 padded to max_sequence_length: the transformer attends to every T5 row
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
            )
            return self._dense(prefix, embeds, pooled)
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return self._dense(prefix, embeds, pooled)

    def _zimage(self, prompts: list[str]) -> list[torch.Tensor]:
        """Z-Image's ``encode_prompt`` without CFG: each prompt's valid ``[L_i, D]`` rows, as the pipeline gives its
        transformer. A prompt whose template fills ``max_sequence_length`` was cut there: said once."""
        # encode_prompt writes the templated text back into the list it is given: hand it a copy
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        for prompt, e in zip(prompts, embeds, strict=True):
            if e.shape[0] >= self.max_sequence_length:  # full: count the templated prompt's tokens uncut
                messages = [{"role": "user", "content": prompt}]
                text = self.pipe.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
                )
                n = len(self.pipe.tokenizer(text).input_ids)
                if n > self.max_sequence_length:
                    warn_truncated(
                        "PipelineTextEncoder (ZImagePipeline)",
                        prompt,
                        n,
                        self.max_sequence_length,
                        "text.max_sequence_length (chat template included)",
                    )
        return [e.float().cpu() for e in embeds]

    def _hunyuan15(self, prompts: list[str], prefix: str) -> dict[str, Any]:
        """HunyuanVideo-1.5's ``encode_prompt``: both streams cut to each prompt's valid rows (``{prefix}prompt_embeds``
        and ``{prefix}prompt_embeds_2``, with their masks). A prompt that fills the pipeline's MLLM length was cut
        there: said once."""
        embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, dtype=torch.float32, batch_size=len(prompts)
        )
        limit = int(self.pipe.tokenizer_max_length)
        out: dict[str, Any] = {}
        for suffix, e, m in (("", embeds, mask), ("_2", embeds_2, mask_2)):
            rows, masks = [], []
            for prompt, states, keep in zip(prompts, e.float().cpu(), m.cpu().bool(), strict=True):
                if suffix == "" and bool(keep.all()) and keep.numel() >= limit:
                    warn_truncated(
                        f"PipelineTextEncoder ({self.pipeline_class})", prompt, limit, limit, "the pipeline's MLLM limit"
                    )
                valid = states[keep]
                if valid.shape[0] == 0:  # no quoted text: the pipeline's all-masked zeros, one row of them here
                    rows.append(states.new_zeros((1, states.shape[-1])))
                    masks.append(torch.zeros(1, dtype=torch.bool))
                else:
                    rows.append(valid)
                    masks.append(torch.ones(valid.shape[0], dtype=torch.bool))
            out[f"{prefix}prompt_embeds{suffix}"] = rows
            out[f"{prefix}prompt_embeds_mask{suffix}"] = masks
        return out

    def _ltx2(self, prompts: list[str], prefix: str) -> dict[str, Any]:
        """LTX-2's ``encode_prompt`` then its ``connectors``, as ``__call__`` runs them: the video stream
        ``{prefix}prompt_embeds`` and the audio stream ``{prefix}prompt_embeds_2``, both ``max_sequence_length`` rows
        with the connectors' mask. A prompt past ``max_sequence_length`` tokens was cut there: said once."""
        pipe = self.pipe
        embeds, mask, _, _ = pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        side = getattr(pipe.tokenizer, "padding_side", "left")  # encode_prompt sets left padding (Gemma's)
        video, audio, keep = pipe.connectors(embeds, mask, padding_side=side)
        for prompt in prompts:
            n = len(pipe.tokenizer(prompt.strip(), add_special_tokens=True).input_ids)
            if n > self.max_sequence_length:
                warn_truncated(
                    f"PipelineTextEncoder ({self.pipeline_class})", prompt, n, self.max_sequence_length,
                    "text.max_sequence_length",
                )
        keep = keep.cpu().bool()
        return {
            f"{prefix}prompt_embeds": list(video.float().cpu()),
            f"{prefix}prompt_embeds_mask": list(keep),
            f"{prefix}prompt_embeds_2": list(audio.float().cpu()),
            f"{prefix}prompt_embeds_mask_2": list(keep),
        }

    def _flux2_layers(self) -> tuple[int, ...]:
        """The text-encoder layers ``encode_prompt`` stacks by default (its ``text_encoder_out_layers``; [klein]:
        9, 18, 27; [dev]: 10, 20, 30), as ``__call__`` passes them."""
        import inspect

        return tuple(inspect.signature(self.pipe.encode_prompt).parameters["text_encoder_out_layers"].default)

    def _flux2(self, prompts: list[str]) -> torch.Tensor:
        """FLUX.2's ``encode_prompt`` ([klein]: Qwen3, [dev]: Mistral3 after its system message):
        ``[B, max_sequence_length, 3 D]``, every row as the pipeline gives its transformer (padding rows included). A
        prompt whose chat template is cut at ``max_sequence_length``: said once (the pipeline cuts it without a
        word)."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        for prompt in prompts:
            if self.text_family == "Flux2Pipeline":  # as _get_mistral_3_small_prompt_embeds renders it
                from diffusers.pipelines.flux2.pipeline_flux2 import format_input

                messages = format_input([prompt], system_message=self.pipe.system_message)[0]
                text = self.pipe.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
                special = False  # the template writes Mistral's BOS itself
            else:
                messages = [{"role": "user", "content": prompt}]
                text = self.pipe.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
                )
                special = True
            n = len(self.pipe.tokenizer(text, add_special_tokens=special).input_ids)
            if n > self.max_sequence_length:
                warn_truncated(
                    f"PipelineTextEncoder ({self.pipeline_class})",
                    prompt,
                    n,
                    self.max_sequence_length,
                    "text.max_sequence_length (chat template included)",
                )
        return embeds

    def _qwen(self, prompts: list[str] | str, image: Any = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Qwen-Image(-Edit)'s ``encode_prompt``: ragged, as the pipeline gives its transformer (each prompt's rows,
        a mask over them)."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        extra = {} if image is None else {"image": image}
        embeds, mask = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length, **extra
        )
        lengths = mask.sum(dim=1).tolist() if mask is not None else [embeds.shape[1]] * len(prompts)
        return (
            [e[: int(n)].float().cpu() for e, n in zip(embeds, lengths, strict=True)],
            [torch.ones(int(n), dtype=torch.bool) for n in lengths],
        )
