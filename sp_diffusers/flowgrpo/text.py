"""Prompt encoders: the embedded default (a tiny, random ``transformers`` model over UTF-8 bytes) and a
diffusers pipeline's own text encoders (``PipelineTextEncoder``, for real checkpoints).

Real pipelines encode prompts with a large text model (Qwen2.5-VL for Qwen-Image); the embedded default
keeps the same shape of data with no download: byte-level ids (so prompts of different lengths give
ragged embeddings and masks that the engine must pad), a real ``transformers`` decoder layer stack with
a fixed seed (identical on every rank), frozen.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["DEFAULT_PROMPTS", "ByteTextEncoder", "PipelineTextEncoder"]

COLORS = ("red", "green", "blue", "yellow")
OBJECTS = ("cat", "house", "bicycle", "mountain lake", "teapot", "lighthouse at dusk")
DEFAULT_PROMPTS = tuple(f"a {color} {obj}" for color in COLORS for obj in OBJECTS)

_PAD, _BOS, _EOS = 256, 257, 258


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
            raw = list(p.encode("utf-8"))[: self.max_length]
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

    def encode_batch(self, prompts: list[str], prefix: str = "") -> dict[str, Any]:
        """``{prefix}prompt_embeds`` / ``{prefix}prompt_embeds_mask`` (ragged lists) for a trainer batch."""
        embeds, masks = self.encode(prompts)
        return {f"{prefix}prompt_embeds": embeds, f"{prefix}prompt_embeds_mask": masks}


class PipelineTextEncoder:
    """A diffusers pipeline's own text encoders (``text.pipeline``: a pipeline folder, e.g. SD3.5-Medium).

    Loads the pipeline without its transformer and VAE and calls its ``encode_prompt``, so prompts are
    encoded exactly as at inference: for ``StableDiffusion3Pipeline`` CLIP-L + CLIP-G (pooled, and
    hidden states padded to T5's width) followed by T5 (``max_sequence_length`` tokens). SD3 attends to
    every text token, padding included, so the masks are all True. Frozen, no gradients.
    """

    SUPPORTED = ("StableDiffusion3Pipeline",)

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
            self.pipe = DiffusionPipeline.from_pretrained(path, transformer=None, vae=None, **kwargs)
        self.pipe.set_progress_bar_config(disable=True)
        self.device = torch.device(device)
        for component in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            module = getattr(self.pipe, component, None)
            if module is not None:
                module.to(self.device).requires_grad_(False).eval()
        self.max_sequence_length = max_sequence_length

    @property
    def hidden_size(self) -> int:
        return int(self.pipe.text_encoder_3.config.d_model)

    @torch.no_grad()
    def encode_batch(self, prompts: list[str], prefix: str = "") -> dict[str, Any]:
        """``{prefix}prompt_embeds`` (list of ``[L, D]``), ``..._mask`` (all True), ``{prefix}pooled_prompt_embeds``
        ``[B, P]``: what ``StableDiffusion3Pipeline.__call__`` passes its transformer."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        embeds, pooled = embeds.float().cpu(), pooled.float().cpu()
        return {
            f"{prefix}prompt_embeds": list(embeds),
            f"{prefix}prompt_embeds_mask": [torch.ones(embeds.shape[1], dtype=torch.bool)] * len(prompts),
            f"{prefix}pooled_prompt_embeds": pooled,
        }
