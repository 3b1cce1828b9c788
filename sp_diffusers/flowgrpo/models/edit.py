"""The editing families: Qwen-Image-Edit (and its multi-image Plus) and FLUX.1 Kontext, called as their pipelines call
them.

Both pipelines encode the condition image(s) with the VAE, pack them 2 x 2 like the noisy latents and put the packed
condition tokens after the noisy ones in the same sequence (``[B, L + L_c, 4 C]``); the transformer attends over both
and the pipeline keeps the first L tokens of its output. So under SP the condition tokens are sharded with the rest
by the model's own plan (they are one ``hidden_states``); the adapter slices the output back (``noisy_output``).

- **Qwen-Image-Edit**: ``img_shapes`` lists both grids, ``[(1, h, w), (1, h_c, w_c)]`` (RoPE per image); the prompt
  is read by Qwen2.5-VL together with the image (``text.PipelineTextEncoder``). Plus: several images, each its own
  grid; Qwen-Image-Edit-2511's ``zero_cond_t`` (timestep 0 for the condition tokens) is the transformer's own.
- **FLUX.1 Kontext**: the condition tokens' ids are ``(1, row, column)`` (the noisy ones' ``(0, row, column)``).

**Condition size.** Each pipeline resizes the condition image to about 1 MP whatever the output size (Qwen-Image-Edit
``calculate_dimensions(1024**2, ratio)``; Kontext the preferred resolution nearest the image's ratio). A training
batch stacks several rows, so every row's condition takes one size: the pipeline's rule at the *output's* aspect
ratio (a source of another ratio is stretched, as flow_grpo resizes its reference images), and
``model.condition_area`` replaces the ~1 MP area (tiny runs). For a source of the output's ratio this is exactly the
pipeline's own preparation (``tests/test_pipeline_io.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .adapters import QwenImageAdapter
from .flux import FluxAdapter
from .prompt_cache import cat_padded

__all__ = ["FluxKontextAdapter", "QwenImageEditAdapter", "edit_adapter"]


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows ``[1, L_i, C]`` -> ``[R, max L_i, C]`` float32 on the CPU, a shorter row zero-padded at the end (rows with
    fewer condition images: ``condition_counts`` says how many tokens of each row are its own)."""
    return cat_padded([p.float() for p in parts]).cpu()


class _Joint:
    """The noisy tokens first, the condition tokens after them: the output's first ``tokens`` rows are the velocity."""

    conditioned = True

    def noisy_output(self, out: torch.Tensor) -> torch.Tensor:
        return out[:, : self.tokens]

    def _joint(self, latents: torch.Tensor, condition: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([latents, condition["condition_latents"].to(latents.dtype)], dim=1)


@dataclass(frozen=True)
class QwenImageEditAdapter(_Joint, QwenImageAdapter):
    """``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline``: ``condition_grids`` the packed grid of each
    condition image, ``condition_pixels`` their (height, width) for the VAE, ``text_area`` the Plus pipeline's
    vision-language image area (0: the VAE image itself, as the single-image pipeline reads it)."""

    condition_grids: tuple[tuple[int, int], ...] = ()
    condition_pixels: tuple[int, int] = (0, 0)
    text_area: int = 0
    output_pixels: tuple[int, int] = (0, 0)

    @property
    def images_per_row(self) -> int:
        """The most condition images a row of this run has (rows may have fewer: ``condition_counts``)."""
        return len(self.condition_grids)

    def condition_tokens(self, count: int) -> int:
        """The packed tokens of a row's first ``count`` condition images."""
        return sum(h * w for h, w in self.condition_grids[:count])

    def inputs(self, latents, timestep, embeds, mask, pooled=None, condition=None) -> dict[str, Any]:
        """The forward kwargs of a batch whose rows have one count of condition images: ``condition["condition_counts"]``
        (host ints, one per row; absent: every row has ``images_per_row``), whose ``condition_latents`` may be
        zero-padded past that count's tokens (a mixed batch's: ``sampling/denoise.velocity`` runs one forward per
        count); the padding is cut here, so the forward sees the row alone's sequence."""
        kwargs = super().inputs(latents, timestep, embeds, mask, pooled)
        count, tokens = self.images_per_row, condition["condition_latents"]
        counts = condition.get("condition_counts")
        if counts is not None and len(counts):
            count = counts[0]
            if any(c != count for c in counts):
                raise ValueError(
                    f"QwenImageEditAdapter.inputs: rows with {sorted(set(counts))} condition images in one forward (the "
                    "transformer has no mask over image tokens); fix: one forward per count (sampling/denoise.velocity)"
                )
            want = self.condition_tokens(count)
            if tokens.shape[1] > want:
                tokens = tokens[:, :want]
            elif tokens.shape[1] < want:  # a stand-in row of another count (denoise.velocity keeps ranks in step)
                tokens = F.pad(tokens, (0, 0, 0, want - tokens.shape[1]))
        kwargs["hidden_states"] = torch.cat([latents, tokens.to(latents.dtype)], dim=1)
        shapes = [(1, self.grid_h, self.grid_w), *((1, h, w) for h, w in self.condition_grids[:count])]
        kwargs["img_shapes"] = [shapes] * latents.shape[0]
        return kwargs

    @torch.no_grad()
    def prepare_condition(
        self, pipe: Any, images: list[list[Any]]
    ) -> tuple[dict[str, torch.Tensor], list[Any]]:
        """Each row's images -> ``condition_latents [R, L_c, 4 z]`` (the VAE latents packed, the row's images one after
        the other) and what the text encoder reads with the prompt (the pipeline's ``prompt_image``)."""
        h, w = self.condition_pixels
        proc, vae = pipe.image_processor, pipe.vae
        latents, text_images = [], []
        for row in images:
            if self.text_area:  # Plus: the VL image at its own area and ratio, the VAE image at the run's size
                module = _module(pipe)
                sizes = [module.calculate_dimensions(self.text_area, im.size[0] / im.size[1])[:2] for im in row]
                text_images.append([proc.resize(im, ch, cw) for im, (cw, ch) in zip(row, sizes, strict=True)])
                pixels = [proc.preprocess(im, h, w).unsqueeze(2) for im in row]
            else:
                resized = proc.resize(row[0], h, w)
                text_images.append(resized)
                pixels = [proc.preprocess(resized, h, w).unsqueeze(2)]
            packed = []
            for px in pixels:
                z = pipe._encode_vae_image(px.to(vae.device, vae.dtype), generator=None)
                packed.append(pipe._pack_latents(z, 1, z.shape[1], z.shape[3], z.shape[4]))
            latents.append(torch.cat(packed, dim=1))
        return {"condition_latents": _stack(latents)}, text_images


@dataclass(frozen=True)
class FluxKontextAdapter(_Joint, FluxAdapter):
    """``FluxKontextPipeline``: ``condition_grid`` the packed grid of the condition image, ``condition_pixels`` its
    (height, width)."""

    condition_grid: tuple[int, int] = (0, 0)
    condition_pixels: tuple[int, int] = (0, 0)
    output_pixels: tuple[int, int] = (0, 0)
    images_per_row: int = 1

    def condition_ids(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[h_c w_c, 3]``: ``(1, row, column)``, as ``FluxKontextPipeline.prepare_latents`` sets them."""
        h, w = self.condition_grid
        ids = FluxAdapter(h, w, self.channels, self.text_len, None).image_ids(device, dtype)
        ids[:, 0] = 1
        return ids

    def inputs(self, latents, timestep, embeds, mask, pooled=None, condition=None) -> dict[str, Any]:
        kwargs = super().inputs(latents, timestep, embeds, mask, pooled)
        kwargs["hidden_states"] = self._joint(latents, condition)
        ids = kwargs["img_ids"]
        kwargs["img_ids"] = torch.cat([ids, self.condition_ids(ids.device, ids.dtype)], dim=0)
        return kwargs

    @torch.no_grad()
    def prepare_condition(
        self, pipe: Any, images: list[list[Any]]
    ) -> tuple[dict[str, torch.Tensor], list[Any]]:
        """Each row's image -> ``condition_latents [R, L_c, 4 z]`` (``_encode_vae_image``, packed); Kontext's text
        does not read the image."""
        h, w = self.condition_pixels
        proc, vae = pipe.image_processor, pipe.vae
        latents = []
        for row in images:
            px = proc.preprocess(proc.resize(row[0], h, w), h, w)
            z = pipe._encode_vae_image(px.to(vae.device, vae.dtype), generator=None)
            latents.append(pipe._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3]))
        return {"condition_latents": _stack(latents)}, [None] * len(images)


def _module(pipe: Any) -> Any:
    import importlib

    return importlib.import_module(type(pipe).__module__)


def _kontext_pixels(ratio: float, area: int, multiple: int) -> tuple[int, int]:
    """Kontext's condition (height, width): the preferred resolution nearest ``ratio`` (the pipeline's
    ``_auto_resize``), or ``area`` pixels at ``ratio``; floored to ``multiple`` as the pipeline does."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    if area:
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
    else:
        _, w, h = min((abs(ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return h // multiple * multiple, w // multiple * multiple


def edit_adapter(
    base: QwenImageAdapter | FluxAdapter, kind: str, pipe: Any, area: int, images_per_row: int = 1
) -> QwenImageEditAdapter | FluxKontextAdapter:
    """The edit adapter over ``base`` (the family's text-to-image adapter at the output's latent grid) for the pipeline
    ``pipe`` (its VAE's scale), the condition area ``area`` (0: the pipeline's) and, for Plus, the images per row."""
    scale = pipe.vae_scale_factor
    out = (base.grid_h * 2 * scale, base.grid_w * 2 * scale)  # output pixels: 2 x 2 packing, then the VAE
    ratio = out[1] / out[0]
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    if kind == "kontext":
        h, w = _kontext_pixels(ratio, area, scale * 2)
        grid = (h // scale // 2, w // scale // 2)
        return FluxKontextAdapter(**fields, condition_grid=grid, condition_pixels=(h, w), output_pixels=out)
    module = _module(pipe)
    plus = kind == "qwen-edit-plus"
    vae_area = area or (module.VAE_IMAGE_SIZE if plus else 1024 * 1024)
    w, h = module.calculate_dimensions(vae_area, ratio)[:2]  # (width, height[, None]): the module's own rounding
    count = images_per_row if plus else 1
    grids = ((h // scale // 2, w // scale // 2),) * count
    text_area = module.CONDITION_IMAGE_SIZE if plus else 0
    return QwenImageEditAdapter(
        **fields, condition_grids=grids, condition_pixels=(h, w), text_area=text_area, output_pixels=out
    )
