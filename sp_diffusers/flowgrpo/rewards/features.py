"""Each sample's features, scored beside its rewards where an algorithm reads them (GARDO's diversity weights):
``[b, D]`` float64 per sample, from the same decoded pixels the rewards read.

- :class:`ImageFeatures`: a vision model from a local ``transformers`` folder (DINOv2, DINOv3: anything
  ``AutoModel`` loads whose output has ``pooler_output``, else the first token of ``last_hidden_state``). Images
  ``[b, 3, H, W]`` in [0, 1] are resized (bicubic) to the model's input size and normalised as its
  ``preprocessor_config.json`` says (ImageNet's mean and std without one), in torch; a video ``[b, F, 3, H, W]`` gives
  its frames' mean feature.
- :class:`LatentFeatures`: the final latents as the rewards see them (``adapter.reward_view``), flattened; no model,
  no VAE.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["Features", "ImageFeatures", "LatentFeatures", "features_for"]

_MEAN = (0.485, 0.456, 0.406)  # ImageNet's, what DINO models are trained with
_STD = (0.229, 0.224, 0.225)


class Features:
    """``__call__(data) -> [b, D]`` float64 on the CPU; ``input``: ``pixels`` or ``latents`` (what it reads)."""

    input: str = "pixels"

    def __call__(self, data: torch.Tensor) -> torch.Tensor:  # pragma: no cover - the interface
        raise NotImplementedError

    def width(self, latents: torch.Tensor) -> int:  # pragma: no cover - the interface
        """``D`` for samples of ``latents``' shape (an SP rank with no share of the samples still sends ``[0, D]``)."""
        raise NotImplementedError


class ImageFeatures(Features):
    """A ``transformers`` vision model's pooled features of decoded images (module docstring)."""

    input = "pixels"

    def __init__(self, folder: str | Path, device: torch.device | str = "cpu") -> None:
        from transformers import AutoModel

        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"flowgrpo.gardo.features={str(folder)!r} is not a model folder (no config.json); fix: a folder written "
                "by save_pretrained of a DINOv2 / DINOv3 model (e.g. a downloaded facebook/dinov2-base), or `latents`"
            )
        self.device = torch.device(device)
        self.model = AutoModel.from_pretrained(folder).to(self.device).eval().requires_grad_(False)
        size = getattr(self.model.config, "image_size", 224)
        mean, std = _MEAN, _STD
        pre = folder / "preprocessor_config.json"
        if pre.is_file():
            cfg = json.loads(pre.read_text())
            crop = cfg.get("crop_size") or cfg.get("size") or size
            if isinstance(crop, dict):
                crop = crop.get("height", crop.get("shortest_edge", size))
            size = int(crop)
            mean, std = cfg.get("image_mean", mean), cfg.get("image_std", std)
        self.size = int(size)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim not in (4, 5) or images.shape[-3] != 3:
            raise ValueError(
                f"image features: pixels must be [b, 3, H, W] or [b, F, 3, H, W] in [0, 1], got {tuple(images.shape)}"
            )
        b = images.shape[0]
        flat = images.reshape(-1, *images.shape[-3:]).to(self.device, torch.float32)
        x = torch.nn.functional.interpolate(flat, size=(self.size, self.size), mode="bicubic", align_corners=False)
        x = (x.clamp(0, 1) - self.mean) / self.std
        out = self.model(pixel_values=x.to(self.model.dtype))
        pooled = getattr(out, "pooler_output", None)
        if pooled is None:
            pooled = out.last_hidden_state[:, 0]
        return pooled.reshape(b, -1, pooled.shape[-1]).mean(dim=1).to("cpu", torch.float64)

    def width(self, latents: torch.Tensor) -> int:
        return int(self.model.config.hidden_size)


class LatentFeatures(Features):
    """The final latents, as the rewards read them, flattened: features without a model."""

    input = "latents"

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.flatten(1).to("cpu", torch.float64)

    def width(self, latents: torch.Tensor) -> int:
        return int(latents[:0].flatten(1).shape[1])


def features_for(name: str | None, device: torch.device | str) -> Features | None:
    """``Algorithm.image_features``'s answer as a :class:`Features` (None: none)."""
    if not name:
        return None
    if name == "latents":
        return LatentFeatures()
    return ImageFeatures(name, device)
