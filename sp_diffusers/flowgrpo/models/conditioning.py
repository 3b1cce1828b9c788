"""Rows with images -> what an image-conditioned family's transformer reads beside the noisy latents, prepared once per
prompt and shared by its group. The loop names no family: it asks the adapter.

An image-conditioned adapter (``edit.py``: Qwen-Image-Edit, FLUX.1 Kontext; ``i2v.py``: Wan I2V / TI2V) has
``conditioned = True`` and:

- ``prepare_condition(pipe, images) -> (tensors, text_images)``: each row's images through the pipeline's own
  preprocessing and VAE (and image encoder), as its ``__call__`` prepares them: ``condition_*`` tensors ``[R, ...]``,
  and what the text encoder reads with each prompt (Qwen-Image-Edit: the image; None elsewhere);
- ``inputs(latents, timestep, embeds, mask, pooled, condition)``: the forward kwargs with the condition joined
  (sequence, channels, ids, per-token timesteps); ``noisy_output(out)``: the velocity of the noisy latents;
  optionally ``final_latents(latents, condition)`` (TI2V's first frame).

The batch carries ``condition_*`` tensors beside the text (the engine broadcasts them to the SP group like the text;
``sampling/guidance.paired`` repeats them for the unconditional branch) and ``source_pixels`` ``[B, N, 3, H, W]``
uint8: each row's images at the output size, which rewards read as ``metadata["source_image"]`` (``[3, H, W]`` float
in [0, 1]) and ``metadata["source_images"]`` beside the row's own fields.

Qwen-Image-Edit-Plus rows may carry different numbers of images (1 to 3) in one run: a batch's ``condition_latents``
and ``source_pixels`` are zero-padded to its largest count, with ``condition_counts`` (host ints, one per row) beside
them; ``sampling/denoise.velocity`` runs one forward per count (``batch.agreed_count_groups``: the counts of every
rank's batch, so that FSDP's gathers pair up), and the adapter cuts each forward's condition tokens to its count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..io.data import PromptRow
from ..io.images import load_row_images, source_pixels
from .prompt_cache import ConditionCache, PromptCache, cat_padded

__all__ = [
    "ConditionEncoder",
    "PromptEncoder",
    "build_conditioning",
    "conditioned_adapter",
    "is_conditioned",
    "text_lengths",
    "with_sources",
]


def is_conditioned(adapter: Any) -> bool:
    return bool(getattr(adapter, "conditioned", False))


def conditioned_adapter(
    base: Any, model: torch.nn.Module, kind: str, pipe: Any, area: int = 0, images: int = 1
) -> Any:
    """The adapter of condition ``kind`` (``folder_checks.PIPELINE_CONDITIONS``) over the family's ``base`` adapter;
    ``pipe``: the loaded pipeline (its VAE's scales), ``area``: ``model.condition_area``, ``images``: per row."""
    if kind in ("qwen-edit", "qwen-edit-plus", "kontext"):
        from .edit import edit_adapter

        return edit_adapter(base, kind, pipe, area, images)
    if kind in ("wan-i2v", "wan-ti2v"):
        from .i2v import wan_i2v_adapter

        return wan_i2v_adapter(base, model, kind, pipe)
    raise ValueError(f"no adapter for the condition {kind!r}")


# the condition images a row may carry, by condition kind (folder_checks.PIPELINE_CONDITIONS): Qwen-Image-Edit-Plus
# (2509 / 2511) edits from 1 to 3 images; the other editing and image-to-video pipelines from one
MAX_CONDITION_IMAGES = {"qwen-edit-plus": 3}


def _repeat(value: Any, times: int) -> Any:
    if torch.is_tensor(value):
        return value.repeat_interleave(times, dim=0)
    return [v for v in value for _ in range(times)]


class ConditionEncoder:
    """``encode(rows, repeat, negative)``: the batch entries of ``rows`` (text, ``condition_*``, ``source_pixels``),
    each row's repeated ``repeat`` times (its group), with the empty prompt's text for CFG when ``negative``."""

    def __init__(self, text_encoder: Any, adapter: Any, pipeline_class: str) -> None:
        self.text, self.adapter, self.pipeline_class = text_encoder, adapter, pipeline_class

    def _images(self, rows: list[PromptRow]) -> list[list[Any]]:
        most = self.adapter.images_per_row
        out = []
        for row in rows:
            where = row.where or "a prompt"
            if not row.images:
                raise ConfigError(
                    f"{where}: the row has no image, and model.pipeline is a {self.pipeline_class}, which is conditioned "
                    f'on one; fix: {{"prompt": ..., "image": "path"}} in a .jsonl file (every row of data.train and '
                    "data.eval)"
                )
            if len(row.images) > most:
                raise ConfigError(
                    f"{where}: {len(row.images)} image(s), but this run's adapter takes at most {most} per row (the "
                    f"most of the rows of data.train and data.eval); fix: at most {most} image(s) in the row"
                )
            out.append(load_row_images(row.images, where))
        return out

    @torch.no_grad()
    def encode(self, rows: list[PromptRow], repeat: int = 1, negative: bool = False) -> dict[str, Any]:
        images = self._images(rows)
        condition, text_images = self.adapter.prepare_condition(self.text.pipe, images)
        prompts = [r.prompt for r in rows]
        out: dict[str, Any] = {**self.text.encode_batch(prompts, images=text_images), **condition}
        if negative:
            out.update(self.text.encode_batch([""] * len(rows), prefix="negative_", images=text_images))
        h, w = self.adapter.output_pixels
        out["source_pixels"] = cat_padded([source_pixels(im, h, w)[None] for im in images])
        if self.counted:
            out["condition_counts"] = [len(im) for im in images]
        return {k: _repeat(v, repeat) for k, v in out.items()}

    @property
    def counted(self) -> bool:
        """Whether the batch carries ``condition_counts``: an adapter whose rows may have different numbers of
        condition images (Qwen-Image-Edit-Plus with rows of 2 or 3)."""
        return self.adapter.images_per_row > 1

    def fitted(self, cond: dict[str, Any]) -> dict[str, Any]:
        """``cond`` (rows from the cache: each zero-padded to the most images of the batch it was encoded in) cut to
        its own rows' most images: the batch's shapes depend on its rows alone."""
        counts = cond.get("condition_counts")
        if not counts:
            return cond
        most = max(counts)
        out = dict(cond)
        out["condition_latents"] = cond["condition_latents"][:, : self.adapter.condition_tokens(most)]
        out["source_pixels"] = cond["source_pixels"][:, :most]
        return out


class PromptEncoder:
    """Prompt rows -> what the transformer is conditioned on (``IterationBatch.cond``: each prompt's text, the empty
    prompt's for classifier-free guidance when ``negative``, an image-conditioned family's ``condition_*``) and that
    family's source pixels (None for a text-only family); each row's condition is encoded once and shared by the
    ``repeat`` samples of its group. Each prompt (a text-only family) or each row with its images (an
    image-conditioned one) goes through the encoders once per run (``prompt_cache.py``, ``cache_mb``).

    ``lengths`` (the adapter's ``host_text_lengths``: Z-Image, which hands its transformer each caption's valid rows
    only): each text's ``{key}_lengths`` too, a host list of each row's valid token count (:func:`text_lengths`),
    counted here from the host masks, so that no forward has to read a mask on the device to cut the rows."""

    def __init__(
        self,
        text_encoder: Any,
        conditioner: ConditionEncoder | None,
        negative: bool,
        cache_mb: float = 0.0,
        lengths: bool = False,
    ) -> None:
        self.text, self.conditioner, self.negative = text_encoder, conditioner, negative
        self.lengths = lengths
        self.cache = PromptCache(text_encoder, cache_mb)
        self.conditions = ConditionCache(cache_mb)  # an image-conditioned family's rows, each encoded once
        self.text_length = 0  # every prompt's text padded to this many tokens (masked), once prepare() knows it

    def prepare(self, prompts: list[str], length_of: Callable[[int], int]) -> None:
        """Encode the run's whole prompt set now (a text-only family), and pad every later prompt's text to
        ``length_of(the longest)`` tokens: one text shape for the run (a compiled model's graphs)."""
        if self.conditioner is not None:
            return
        longest = self.cache.encode_all([*prompts, *([""] if self.negative else [])])
        self.text_length = length_of(longest)

    def encode(self, rows: list[PromptRow], repeat: int = 1) -> tuple[dict[str, Any], torch.Tensor | None]:
        if self.conditioner is None:
            prompts = [r.prompt for r in rows for _ in range(repeat)]
            cond = self._padded(self.cache.encode_batch(prompts))
            if self.negative:
                cond.update(self._padded(self.cache.encode_batch([""] * len(prompts), prefix="negative_")))
            return self._with_lengths(cond), None
        conditioner = self.conditioner
        cond = self.conditions.encode(rows, lambda missing: conditioner.encode(missing, 1, negative=self.negative))
        cond = {k: _repeat(v, repeat) for k, v in conditioner.fitted(cond).items()}
        return self._with_lengths(cond), cond.pop("source_pixels")

    @property
    def seconds(self) -> float:
        """Time spent in the encoders so far (text, and an image-conditioned family's VAE and image encoder)."""
        return self.cache.seconds + self.conditions.seconds

    def _with_lengths(self, cond: dict[str, Any]) -> dict[str, Any]:
        if self.lengths:
            for key in [k for k in cond if k.endswith("prompt_embeds")]:
                cond[f"{key}_lengths"] = text_lengths(cond[f"{key}_mask"], key)
        return cond

    def _padded(self, cond: dict[str, Any]) -> dict[str, Any]:
        if not self.text_length:
            return cond
        out = dict(cond)
        for key in [k for k in cond if k.endswith("prompt_embeds")]:
            embeds, masks = cond[key], cond[f"{key}_mask"]
            pad = [max(self.text_length - e.shape[0], 0) for e in embeds]  # a longer one keeps its length
            out[key] = [F.pad(e, (0, 0, 0, n)) for e, n in zip(embeds, pad, strict=True)]
            out[f"{key}_mask"] = [F.pad(m, (0, n), value=False) for m, n in zip(masks, pad, strict=True)]
        return out


def text_lengths(masks: Any, name: str = "prompt_embeds") -> list[int]:
    """Each row's valid token count, as host ints, from its host mask (``[L_i]`` each, or ``[B, L]``), whose valid
    tokens must come first (the text encoders' and ``PromptEncoder``'s padding is at the end): a count is then the
    slice ``[:n]`` that the mask selects. Read on the host, when a batch is made: a CPU mask costs no device sync."""
    out = []
    for i, mask in enumerate(masks):
        keep = mask.detach().to("cpu", torch.bool)
        n = int(keep.sum())
        if not bool(keep[:n].all()):
            raise ValueError(
                f"{name}_mask row {i} has padding between its valid tokens ({keep.int().tolist()}); the text lengths "
                "carried beside it assume each row's valid tokens first; fix: a text encoder that pads at the end"
            )
        out.append(n)
    return out


def with_sources(metadata: list[dict] | None, pixels: torch.Tensor | None, count: int) -> list[dict]:
    """Each sample's metadata with its source image(s) as pixels: ``source_image`` ``[3, H, W]`` and
    ``source_images`` (a list), float32 in [0, 1] on the CPU."""
    metadata = list(metadata) if metadata is not None else [{} for _ in range(count)]
    if pixels is None:
        return metadata
    images = pixels.detach().float().cpu() / 255.0
    return [
        {**m, "source_image": images[i, 0], "source_images": list(images[i, : _image_count(m, images.shape[1])])}
        for i, m in enumerate(metadata)
    ]


def _image_count(metadata: dict, most: int) -> int:
    """A row's own number of source images, from its ``image`` / ``images`` field (``io/data.PromptRow.metadata``
    keeps the row's fields): a batch whose rows have different counts zero-pads its pixels to the most."""
    if isinstance(metadata.get("images"), list):
        return min(len(metadata["images"]), most)
    return 1 if isinstance(metadata.get("image"), str) else most


def build_conditioning(
    config: Any, model: torch.nn.Module, text_encoder: Any, base: Any, rows: list[PromptRow]
) -> tuple[Any, Any]:
    """``(adapter, ConditionEncoder or None)`` for the run: ``base`` (the family's adapter) as it is for a
    text-to-image / text-to-video pipeline, else the condition's adapter and encoder (``model.pipeline``'s condition,
    ``pipeline_io.condition_kind``). ``rows``: the prompt rows (data.train, data.eval), which must carry images for a
    conditioned pipeline and must not for another."""
    from .pipeline_io import condition_kind

    kind = condition_kind(config)
    with_images = next((r for r in rows if r.images), None)
    if not kind:
        if with_images is not None:
            raise ConfigError(
                f'{with_images.where}: the row names an image ("image" / "images"), but model.pipeline='
                f"{config.model.pipeline or '(none)'} is not conditioned on images; fix: an editing or image-to-video "
                "pipeline folder (Qwen-Image-Edit, FLUX.1 Kontext, Wan I2V), or another field name for what your "
                "reward reads"
            )
        return base, None
    if not rows:
        raise ConfigError(
            f"model.pipeline={config.model.pipeline!r} is conditioned on images ({kind}): fix: data.train=<a .jsonl "
            'file of {"prompt": ..., "image": "path"} rows>'
        )
    most = MAX_CONDITION_IMAGES.get(kind, 1)
    over = next((r for r in rows if len(r.images) > most), None)
    if over is not None:
        takes = f"1 to {most} condition images" if most > 1 else "one condition image"
        raise ConfigError(
            f"{over.where or 'a prompt row'}: {len(over.images)} images, but model.pipeline's {kind} takes {takes} per "
            f"row; fix: at most {most} in each row's \"images\""
        )
    counts = {len(r.images) for r in rows if r.images}
    images = max(counts) if counts else 1
    adapter = conditioned_adapter(base, model, kind, text_encoder.pipe, config.model.condition_area, images)
    return adapter, ConditionEncoder(text_encoder, adapter, type(text_encoder.pipe).__name__)
