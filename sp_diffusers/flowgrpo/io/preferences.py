"""Offline preference pairs (Diffusion-DPO, ``flowgrpo.dpo.pairs``): a ``.jsonl`` file of
``{"prompt": ..., "chosen": "a.png", "rejected": "b.png"}`` rows, the paths relative to the file's folder: images
for the image families, video files (``.mp4``, ``.webm``, ...: ``media.VIDEO_SUFFIXES``) for the video families.

Rows are read and checked when the run starts (:func:`read_pairs`: every rank reads the file, so every rank refuses a
bad row alike, naming it); the images are decoded and encoded through the pipeline's VAE the first time a batch
needs them and kept on the host (:class:`PairLatents`), where a row whose image (video: frame count too) has another
size than the run's, or whose two sides are the same picture, is refused by line. A row is a
:class:`~.data.PromptRow` whose metadata holds the two resolved paths, so the run visits the pairs as it visits
prompts (``data.PromptStream``: shuffled per epoch, resumed at its position).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import ConfigError
from .data import PromptRow
from .images import MAX_IMAGE_PIXELS, load_row_images, resolve_images, source_pixels
from .media import VIDEO_SUFFIXES, read_video

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
        paths = {f: _resolve(row[f], p.parent, f'{where} ("{f}")', key, max_pixels) for f in FIELDS}
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


def _resolve(name: str, base: Path, where: str, key: str, max_pixels: int) -> str:
    """An image checked as a prompt row's images are (``images.resolve_images``), or a video file that exists."""
    if Path(name).suffix.lower() not in VIDEO_SUFFIXES:
        return resolve_images({"image": name}, base, where, key, max_pixels)[0]
    path = (base / name).resolve()
    if not path.is_file():
        raise ConfigError(
            f"{key}: {where}: video {name!r} ({path}) does not exist; fix: a readable video file "
            f"({', '.join(VIDEO_SUFFIXES)}) at that path, relative to the {key} file's folder or absolute"
        )
    return str(path)


def _is_video(path: str) -> bool:
    return Path(path).suffix.lower() in VIDEO_SUFFIXES


class PairLatents:
    """The latents of pairs ``[2 R, ...]`` (chosen, rejected, chosen, ...), each image (or video) decoded, checked
    against the run's ``size`` ((height, width), or (frames, height, width) for a video model) and encoded by
    ``encode`` (pixels ``[b, 3, H, W]`` or ``[b, F, 3, H, W]`` in [0, 1] -> latents) once, then kept on the host by
    path."""

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

    def _pixels(self, row: PromptRow, field: str) -> torch.Tensor:
        """One side of a pair as uint8 ``[3, H, W]`` (``[F, 3, H, W]``), its kind and size checked."""
        path, video = row.metadata[field], len(self.size) == 3
        if _is_video(path) != video:
            want = "a video file" if video else "an image"
            raise ConfigError(
                f"{self.key}: {row.where}: {field} {path} is not {want}, which this model makes; fix: "
                f"{want} ({', '.join(VIDEO_SUFFIXES)} for a video model)"
            )
        if video:
            try:
                pixels = read_video(path)
            except Exception as err:
                raise ConfigError(
                    f"{self.key}: {row.where}: {field} {path} cannot be read as a video ({type(err).__name__}: "
                    f"{err}); fix: a readable video file"
                ) from err
        else:
            im = load_row_images((path,), row.where)[0]
            pixels = source_pixels([im], im.size[1], im.size[0])[0]
        shape = (pixels.shape[0], *pixels.shape[2:]) if video else tuple(pixels.shape[1:])
        if shape != self.size:
            names = "frames x height x width" if video else "height x width"
            raise ConfigError(
                f"{self.key}: {row.where}: {field} {path} is {' x '.join(map(str, shape))} ({names}), the run's "
                f"are {' x '.join(map(str, self.size))}; fix: make the pair that size (a resize would change what was "
                "preferred), or set the run's size to the data's"
            )
        return pixels

    def _encode(self, rows: list[PromptRow]) -> None:
        pixels = []
        for row in rows:
            chosen, rejected = (self._pixels(row, f) for f in FIELDS)
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
