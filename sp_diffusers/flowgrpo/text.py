"""Prompts for the embedded default: a tiny, randomly initialised ``transformers`` text model over UTF-8 bytes.

Real pipelines encode prompts with a large text model (Qwen2.5-VL for Qwen-Image); the embedded default
keeps the same shape of data with no download: byte-level ids (so prompts of different lengths give
ragged embeddings and masks that the engine must pad), a real ``transformers`` decoder layer stack with
a fixed seed (identical on every rank), frozen.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_PROMPTS", "ByteTextEncoder"]

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
