"""Offline preference pairs (Diffusion-DPO, ``flowgrpo.dpo.pairs``): a ``.jsonl`` file of
``{"prompt": ..., "chosen": "a.png", "rejected": "b.png"}`` rows, the image paths relative to the file's folder.

Rows are read and checked when the run starts (:func:`read_pairs`: every rank reads the file, so every rank refuses a
bad row alike, naming it); the images are decoded and encoded through the pipeline's VAE the first time a batch
needs them and kept on the host (:class:`PairLatents`), where a row whose image has another size than the run's, or
whose two images are the same picture, is refused by line. A row is a :class:`~.data.PromptRow` whose metadata holds
the two resolved paths, so the run visits the pairs as it visits prompts (``data.PromptStream``: shuffled per epoch,
resumed at its position).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import ConfigError
from .data import PromptRow
from .images import MAX_IMAGE_PIXELS, load_row_images, resolve_images, source_pixels

__all__ = ["PairLatents", "read_pairs"]

FIELDS = ("chosen", "rejected")


def read_pairs(path: str | Path, key: str, max_pixels: int = MAX_IMAGE_PIXELS) -> list[PromptRow]:
    """The rows of a preference ``.jsonl`` (blank lines skipped), each image checked to exist and open; ``key``
    (the config key) and ``file:line`` name a bad row."""
    p = Path(path)
    if p.suffix != ".jsonl" or not p.is_file():
        what = "no such file" if not p.is_file() else "not a .jsonl file"
        raise ConfigError(
            f'{key}={str(path)!r}: {what}; fix: a .jsonl file of {{"prompt": ..., "chosen": "a.png", "rejected": '
            '"b.png"}} rows (paths relative to the file)'
        )
    rows: list[PromptRow] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{key}: {where} is not JSON ({err}); fix: one JSON object per line") from err
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("prompt"), str)
            or not row["prompt"].strip()
            or not all(isinstance(row.get(f), str) and row[f].strip() for f in FIELDS)
        ):
            raise ConfigError(
                f'{key}: {where} needs a "prompt", a "chosen" and a "rejected" string; fix: {{"prompt": "...", '
                '"chosen": "a.png", "rejected": "b.png"}'
            )
        paths = {f: resolve_images({"image": row[f]}, p.parent, f'{where} ("{f}")', key, max_pixels)[0] for f in FIELDS}
        if paths["chosen"] == paths["rejected"]:
            raise ConfigError(
                f"{key}: {where}: chosen and rejected are the same file ({paths['chosen']}); fix: a pair of two "
                "different images, or drop the row"
            )
        others = {k: v for k, v in row.items() if k not in ("prompt", *FIELDS)}
        rows.append(PromptRow(row["prompt"], metadata={**others, **paths}, where=where))
    if not rows:
        raise ConfigError(f"{key}={str(path)!r} holds no pairs; fix: at least one row")
    return rows


class PairLatents:
    """The latents of pairs ``[2 R, ...]`` (chosen, rejected, chosen, ...), each image decoded, checked against the
    run's ``size`` (height, width) and encoded by ``encode`` (pixels ``[b, 3, H, W]`` in [0, 1] -> latents) once,
    then kept on the host by path."""

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], size: tuple[int, int], key: str) -> None:
        self.encode, self.size, self.key = encode, size, key
        self.cache: dict[str, torch.Tensor] = {}

    def __call__(self, rows: list[PromptRow]) -> torch.Tensor:
        missing = {
            tuple(r.metadata[f] for f in FIELDS): r for r in rows if any(r.metadata[f] not in self.cache for f in FIELDS)
        }  # a pair drawn twice in one batch is encoded once
        if missing:
            self._encode(list(missing.values()))
        return torch.stack([self.cache[r.metadata[f]] for r in rows for f in FIELDS])

    def _encode(self, rows: list[PromptRow]) -> None:
        h, w = self.size
        pixels = []
        for row in rows:
            images = load_row_images(tuple(row.metadata[f] for f in FIELDS), row.where)
            for field, im in zip(FIELDS, images, strict=True):
                if (im.size[1], im.size[0]) != (h, w):
                    raise ConfigError(
                        f"{self.key}: {row.where}: {field} {row.metadata[field]} is {im.size[1]} x {im.size[0]} "
                        f"(height x width), the run's images are {h} x {w}; fix: resize the pair to {h} x {w} (a "
                        "resize would change what was preferred), or set the run's size to the data's"
                    )
            chosen, rejected = (source_pixels([im], h, w)[0] for im in images)
            if torch.equal(chosen, rejected):
                raise ConfigError(
                    f"{self.key}: {row.where}: chosen and rejected are the same picture "
                    f"({row.metadata['chosen']}, {row.metadata['rejected']}): the pair prefers nothing; fix: drop "
                    "the row"
                )
            pixels += [chosen, rejected]
        latents = self.encode(torch.stack(pixels).float() / 255.0).cpu()
        for i, row in enumerate(rows):
            for j, field in enumerate(FIELDS):
                self.cache[row.metadata[field]] = latents[2 * i + j]
