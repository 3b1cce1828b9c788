"""Images in prompt rows: ``{"prompt": ..., "image": "path"}`` or ``"images": ["a.png", "b.png"]`` in a ``.jsonl`` file
(paths relative to the file's folder), checked when the file is read and loaded when a batch needs them.

Every rank reads the whole prompt file, so a missing or unreadable image is refused on every rank alike, before any
model is built: one line naming the file, the row, the path and the fix (never a rank that fails alone while its
peers wait in a collective). Reading a file's header is cheap (PIL reads no pixels until asked); a file whose pixels
turn out broken later is refused when its batch loads it, naming the row the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError

__all__ = ["IMAGE_FIELDS", "MAX_IMAGE_PIXELS", "as_rgb", "load_row_images", "resolve_images", "source_pixels"]

IMAGE_FIELDS = ("image", "images")  # the row fields that name condition images
MAX_IMAGE_PIXELS = 178_956_970  # PIL's own decompression-bomb error threshold; data.max_image_pixels sets ours


@contextlib.contextmanager
def _own_pixel_limit() -> Iterator[None]:
    """PIL's global decompression-bomb guard off while this module opens a file: the header's size is checked
    against ``data.max_image_pixels`` instead (PIL's would refuse a larger limit, and warn below it)."""
    from PIL import Image

    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _fix(key: str) -> str:
    return (
        f"fix: a readable image file (PNG, JPEG, WebP, ...) at that path, relative to the {key} file's folder "
        "or absolute; or drop the row"
    )


def resolve_images(
    row: dict[str, Any], base: Path, where: str, key: str, max_pixels: int = MAX_IMAGE_PIXELS
) -> tuple[str, ...]:
    """The absolute paths of ``row``'s ``image`` / ``images`` (``where``: ``file:line``), each checked to exist, to
    open as an image and to hold at most ``max_pixels`` pixels (0: any); ``()`` for a row without them."""
    from PIL import Image, UnidentifiedImageError

    if "image" in row and "images" in row:
        raise ConfigError(
            f'{key}: {where} has both "image" and "images"; fix: one of them ("images": [...] for several)'
        )
    value = row.get("image", row.get("images"))
    if value is None:
        return ()
    names = [value] if "image" in row else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        field = "image" if "image" in row else "images"
        want = "a path string" if field == "image" else "a non-empty list of path strings"
        raise ConfigError(
            f'{key}: {where}: "{field}" is {value!r}, not {want}; fix: {{"prompt": ..., "{field}": ...}}'
        )
    out = []
    for name in names:
        path = (base / name).resolve()
        if not path.is_file():
            raise ConfigError(f"{key}: {where}: image {name!r} ({path}) does not exist; {_fix(key)}")
        try:
            with _own_pixel_limit(), Image.open(path) as im:
                width, height = im.size  # the header parses
        except (UnidentifiedImageError, OSError) as err:
            raise ConfigError(
                f"{key}: {where}: image {name!r} ({path}) cannot be read ({type(err).__name__}: {err}); {_fix(key)}"
            ) from err
        if max_pixels and width * height > max_pixels:
            raise ConfigError(
                f"{key}: {where}: image {name!r} ({path}) is {width} x {height} = {width * height} pixels, more than "
                f"data.max_image_pixels={max_pixels} (a guard against decompression bombs: a small file that "
                "decodes to gigabytes); fix: a smaller image, or raise data.max_image_pixels (0: no limit)"
            )
        out.append(str(path))
    return tuple(out)


def as_rgb(im: Any) -> Any:
    """An opened ``PIL.Image`` as 8-bit RGB with its tonal range kept: turned upright by its EXIF orientation,
    16- and 32-bit greys scaled to 8 bits (PIL's own ``convert`` clips them: a 30000/65535 grey became white),
    float greys read as [0, 1] when they lie there; palette, LA, RGBA and CMYK through PIL's conversions."""
    import numpy as np
    from PIL import Image, ImageOps

    im = ImageOps.exif_transpose(im)
    if im.mode.startswith("I;16") or im.mode in ("I", "F"):
        values = np.asarray(im, dtype=np.float64)
        if im.mode == "F":
            top = 1.0 if values.size and values.max() <= 1.0 else 255.0
        else:
            top = 65535.0 if im.mode.startswith("I;16") or (values.size and values.max() > 255) else 255.0
        grey = np.clip(np.rint(values * (255.0 / top)), 0, 255).astype(np.uint8)
        im = Image.fromarray(grey, mode="L")
    return im.convert("RGB")


def load_row_images(paths: tuple[str, ...], where: str) -> list[Any]:
    """The row's images as RGB ``PIL.Image``s (decoded now); a decoding failure names the row."""
    from PIL import Image

    images = []
    for path in paths:
        try:  # its size was checked when its row was read (resolve_images)
            with _own_pixel_limit(), Image.open(path) as im:
                images.append(as_rgb(im))
        except Exception as err:
            raise ConfigError(
                f"{where}: image {path} cannot be decoded ({type(err).__name__}: {err}); fix: a readable image file"
            ) from err
    return images


def source_pixels(images: list[Any], height: int, width: int) -> torch.Tensor:
    """``[N, 3, height, width]`` uint8: a row's images at the output's size (bicubic), what rewards compare with."""
    import numpy as np
    from PIL import Image

    arrays = [np.asarray(im.resize((width, height), Image.BICUBIC), dtype=np.uint8) for im in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
