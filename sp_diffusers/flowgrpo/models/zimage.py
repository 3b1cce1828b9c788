"""How FlowGRPO calls Z-Image (``ZImageTransformer2DModel``), as ``ZImagePipeline`` calls it.

- Latents: the pipeline's own layout ``[B, C, H, W]`` (``AutoencoderKL`` latents, 16 channels for the released model);
  the transformer takes them as a per-sample list of ``[C, 1, H, W]`` (one frame) and patches 2 x 2 itself.
- Time: the pipeline hands the transformer ``(1000 - t) / 1000`` for the schedule's timestep ``t`` (0..1000 scale):
  Z-Image's time runs from 0 (noise) to 1 (data), the reverse of the scheduler's.
- Text: a per-sample list of ``[L_i, D]``, each caption's valid tokens only (the pipeline drops the padding of its
  ``max_sequence_length`` tokenisation; the model pads every caption to a multiple of 32 itself, with a learned pad
  token and a key mask). The trainer carries dense padded text and a mask, each row's valid tokens first, and beside
  them each row's valid length as a host int (``prompt_embeds_lengths``: ``PromptEncoder`` counts them on the host when
  the batch is made, because :attr:`ZImageAdapter.host_text_lengths` asks; ``IterationBatch.cond_of`` and
  ``guidance.paired`` carry them through micro-batches, chunks and CFG's stacked branches): each row is cut back to
  its length here (a view, no device read), so the engine's padding (to the batch's longest prompt, to the SP degree)
  never reaches the model and a forward costs no host sync. Without lengths (a direct caller: the planner, a test)
  the rows are cut by the mask, which reads it on the host (one sync per row).
- Output: a per-sample list of ``[C, 1, H, W]`` predicting ``noise - data``; the pipeline's velocity is its negative
  (``noise_pred = -out``, then the scheduler's Euler step): :meth:`ZImageAdapter.noisy_output` stacks it, drops
  the frame and negates, so the trainer's velocity is the pipeline's ``noise_pred``.
- Guidance: ``ZImagePipeline`` computes ``pos + g (pos - neg)`` (``guidance_scale`` g; g = 0, Z-Image-Turbo's
  setting, runs no CFG); the trainer's ``flowgrpo.cfg_scale`` s computes ``neg + s (pos - neg)``, so s = 1 + g.
  Both are linear in the branches, so guiding the negated outputs equals negating the guided one (to rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .decode import ImageLatents

__all__ = ["ZImageAdapter", "zimage_adapter"]


@dataclass(frozen=True)
class ZImageAdapter(ImageLatents):
    """``ZImageTransformer2DModel`` at latent ``height`` x ``width`` (multiples of ``patch``), ``channels`` wide."""

    host_text_lengths: ClassVar[bool] = True  # FamilyAdapter's: each caption's valid rows, cut by host lengths

    def noisy_output(self, out: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """The model's per-sample ``[C, 1, H, W]`` list -> the pipeline's velocity ``[B, C, H, W]`` (negated)."""
        stacked = torch.stack(list(out)) if isinstance(out, (list, tuple)) else out
        return -stacked.squeeze(2)

    def inputs(
        self,
        latents: Tensor,
        timestep: Tensor,
        embeds: Tensor,
        mask: Tensor,
        pooled: Tensor | None = None,
        lengths: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """The forward's kwargs. ``lengths``: each row's valid token count (host ints; its valid tokens first, as
        ``mask`` says): the rows are cut to them without reading a tensor. None: cut by ``mask`` (a host read)."""
        batch = latents.shape[0]
        if mask.shape[:2] != embeds.shape[:2]:
            raise ValueError(
                f"ZImageAdapter: text mask {tuple(mask.shape)} does not match the embeddings {tuple(embeds.shape)}"
            )
        if lengths is not None:
            lengths = [int(n) for n in lengths]
            if len(lengths) != embeds.shape[0] or any(not 0 <= n <= embeds.shape[1] for n in lengths):
                raise ValueError(
                    f"ZImageAdapter: text lengths {lengths} do not fit the embeddings {tuple(embeds.shape)}: one per "
                    "row, each at most the padded length"
                )
            # each caption's first n rows: a view (the pipeline's prompt_embeds[i][prompt_masks[i]])
            captions = [e[:n] for e, n in zip(embeds, lengths, strict=True)]
        else:
            keep = mask.bool()
            # the valid rows of each caption, in order (the pipeline's prompt_embeds[i][prompt_masks[i]])
            captions = [e[k] for e, k in zip(embeds, keep, strict=True)]
        if any(c.shape[0] == 0 for c in captions):
            raise ValueError("ZImageAdapter: a prompt has no valid text tokens (an all-False mask row)")
        # float32 whatever the latents' dtype: the pipeline keeps its latents (and so the timestep) in float32 and
        # casts only the latents it hands the model
        t = timestep.to(device=latents.device, dtype=torch.float32).expand(batch)
        return dict(
            x=list(latents.unsqueeze(2).unbind(0)),
            t=(1000 - t) / 1000,
            cap_feats=captions,
        )


def zimage_adapter(model: torch.nn.Module, height: int, width: int) -> ZImageAdapter:
    """The adapter for a Z-Image transformer at the VAE's latent ``height`` x ``width``. ``ZImagePipeline`` calls the
    transformer with its forward's default patch sizes (2 spatial, 1 in time), so the model must have been built
    with them."""
    config = model.config
    if 2 not in tuple(config.all_patch_size) or 1 not in tuple(config.all_f_patch_size):
        raise ValueError(
            f"the FlowGRPO Z-Image adapter calls the transformer as ZImagePipeline does (patch_size 2, f_patch_size "
            f"1); the model has all_patch_size={list(config.all_patch_size)}, all_f_patch_size="
            f"{list(config.all_f_patch_size)}; fix: a Z-Image transformer built with patch 2 and f_patch 1 (as released)"
        )
    return ZImageAdapter(height, width, config.in_channels, 2)
