"""How FlowGRPO calls FLUX.2 (``Flux2Transformer2DModel``), as ``Flux2KleinPipeline`` and ``Flux2Pipeline`` call it.

- Latents: the pipelines patchify each 2 x 2 patch of the ``AutoencoderKLFlux2`` latents into one token,
  ``[B, (H/2)(W/2), 4 C]`` (channel ``4 c + 2 dy + dx``: FLUX.1's packing, ``decode.pack_2x2``), normalised by the
  VAE's batch-norm running statistics over those ``4 C`` channels, and keep them so while denoising. Decoding undoes
  the statistics on the tokens, then unpacks (:meth:`Flux2Adapter.to_vae`), exactly as the pipelines do before
  ``vae.decode``; encoding an image does the reverse (:meth:`Flux2Adapter.from_vae`).
- Ids: four axes ``(t, h, w, l)`` per token, batched ``[B, S, 4]`` as the pipelines pass them (and as diffusers'
  context-parallel plan for the model splits them): image tokens ``(0, row, column, 0)``, text tokens
  ``(0, 0, 0, position)``.
- Time: the schedule's timestep divided by 1000, in the latents' dtype (the transformer scales it back).
- Guidance: [klein] passes ``guidance=None`` (no guidance embedding) and guides by CFG on the empty negative prompt,
  ``neg + g (pos - neg)`` at ``guidance_scale`` g > 1 unless the folder is step-distilled (``is_distilled``: no CFG
  at any g): the trainer's ``flowgrpo.cfg_scale`` s is the same formula, so s = g (s = 1 for the distilled
  [klein]). FLUX.2 [dev] is guidance-distilled (``guidance_embeds``): the pipeline passes ``guidance_scale`` (4 by
  default) as a per-sample ``guidance`` input instead, here ``flowgrpo.guidance_scale``.
- Text: the stacked hidden states of three text-encoder layers (Qwen3 for [klein], Mistral3 for [dev]) padded to
  ``max_sequence_length``; the transformer has no text mask and attends to every row, the padding's included. As
  for FLUX.1, masked rows (the engine's padding to the SP degree) are zeroed and the text is cut or zero-padded to
  ``text_len`` rows, so what the model sees does not depend on how a batch was padded.
- Output: the velocity itself (``noise_pred``; the pipelines keep the first ``L`` tokens, all of them here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .decode import PackedTokens, pack_2x2, unpack_2x2
from .flux import fixed_length

__all__ = ["Flux2Adapter", "flux2_adapter"]


def _bn_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``AutoencoderKLFlux2``'s batch-norm mean and std (``sqrt(running_var + batch_norm_eps)``, computed in the
    buffers' dtype as the pipelines do), shaped ``[1, 1, 4 C]`` to broadcast over packed tokens, in ``like``'s dtype."""
    bn = getattr(vae, "bn", None)
    eps = getattr(vae.config, "batch_norm_eps", None)
    if bn is None or eps is None:
        raise ValueError(
            f"the FLUX.2 adapter normalises latents with AutoencoderKLFlux2's batch-norm statistics; this VAE is a "
            f"{type(vae).__name__} without them; fix: a Flux2KleinPipeline / Flux2Pipeline folder with its own VAE"
        )
    mean = bn.running_mean.view(1, 1, -1).to(like.device, like.dtype)
    std = torch.sqrt(bn.running_var.view(1, 1, -1) + eps).to(like.device, like.dtype)
    return mean, std


@dataclass(frozen=True)
class Flux2Adapter(PackedTokens):
    """``Flux2Transformer2DModel`` on packed tokens ``[B, grid_h * grid_w, channels]``; ``text_len`` text rows;
    ``guidance``: FLUX.2 [dev]'s embedded guidance (None: [klein], no guidance embedding)."""

    text_len: int
    guidance: float | None

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed tokens -> ``[B, C, H, W]`` still normalised (a latent preview's layout; decoding: :meth:`to_vae`)."""
        return unpack_2x2(latents, self.grid_h, self.grid_w)

    def pixel_layout(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels

    def from_vae_latents(self, z: torch.Tensor) -> torch.Tensor:
        return pack_2x2(z)

    def to_vae(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """Tokens -> ``vae.decode``'s input: ``z * std + mean`` per packed channel, then the 2 x 2 patches unpacked
        (the pipelines' ``_unpack_latents_with_ids``, the statistics, ``_unpatchify_latents``)."""
        mean, std = _bn_stats(vae, latents)
        return unpack_2x2(latents * std + mean, self.grid_h, self.grid_w)

    def from_vae(self, vae: Any, z: torch.Tensor) -> torch.Tensor:
        """A posterior's ``[B, C, H, W]`` -> normalised tokens (the pipelines' ``_encode_vae_image`` and packing)."""
        tokens = pack_2x2(z)
        mean, std = _bn_stats(vae, tokens)
        return (tokens - mean) / std

    def image_ids(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[B, h w, 4]`` int64: ``(0, row, column, 0)`` of each token in row-major order
        (``_prepare_latent_ids``)."""
        rows = torch.arange(self.grid_h, device=device)[:, None].expand(self.grid_h, self.grid_w)
        cols = torch.arange(self.grid_w, device=device)[None, :].expand(self.grid_h, self.grid_w)
        zeros = torch.zeros_like(rows)
        ids = torch.stack([zeros, rows, cols, zeros], dim=-1).reshape(1, -1, 4)
        return ids.expand(batch, -1, -1)

    def text_ids(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[B, text_len, 4]`` int64: ``(0, 0, 0, position)`` (``_prepare_text_ids``)."""
        ids = torch.zeros(self.text_len, 4, dtype=torch.int64, device=device)
        ids[:, 3] = torch.arange(self.text_len, device=device)
        return ids.unsqueeze(0).expand(batch, -1, -1)

    def inputs(
        self, latents: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor, pooled: Tensor | None = None
    ) -> dict[str, Any]:
        batch, dtype, device = latents.shape[0], latents.dtype, latents.device
        kwargs: dict[str, Any] = dict(
            hidden_states=latents,
            encoder_hidden_states=fixed_length(embeds, mask, self.text_len),
            timestep=timestep.to(dtype).expand(batch) / 1000.0,
            img_ids=self.image_ids(batch, device),
            txt_ids=self.text_ids(batch, device),
        )
        if self.guidance is not None:  # [dev]: float32, as the pipeline builds it
            kwargs["guidance"] = torch.full((batch,), self.guidance, device=device, dtype=torch.float32)
        return kwargs


def flux2_adapter(
    model: torch.nn.Module, height: int, width: int, text_len: int, guidance_scale: float
) -> Flux2Adapter:
    """The adapter for a FLUX.2 transformer at the VAE's latent ``height`` x ``width`` (both even)."""
    config = model.config
    if config.patch_size != 1:
        raise ValueError(
            f"the FlowGRPO FLUX.2 adapter packs 2 x 2 latents itself, as the FLUX.2 pipelines do; the model has "
            f"patch_size={config.patch_size}; fix: a Flux2Transformer2DModel with patch_size 1 (as released)"
        )
    if text_len < 1:
        raise ValueError(f"text.max_sequence_length={text_len} must be >= 1 (the FLUX.2 pipelines pad prompts to it)")
    guidance = guidance_scale if getattr(config, "guidance_embeds", False) else None
    return Flux2Adapter(height // 2, width // 2, config.in_channels, text_len, guidance)
