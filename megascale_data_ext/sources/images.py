"""Variable-resolution (NaViT-style) image patchification with Pillow.

An image keeps its aspect ratio: it is resized so each side is a multiple of the patch size,
downscaled further when it would exceed ``max_patches``. :func:`image_patch_grid` decides the
grid from width and height alone, so the patch count the Planner balances on (computed from
the image header, or at ``prepare`` time) is exactly the count :func:`decode_patches` yields.
"""

from __future__ import annotations

import io
import math
import re

import numpy as np

from megascale_data_ext.errors import SampleError

#: CLIP's RGB normalization; what common ViT encoders are trained with.
IMAGE_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
IMAGE_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def image_patch_grid(width: int, height: int, *, patch_size: int = 16, max_patches: int = 1024) -> tuple[int, int]:
    """Patch grid ``(rows, cols)`` of an image of ``width`` x ``height`` pixels.

    Each side is rounded to the nearest multiple of ``patch_size`` (at least one patch); if the
    grid holds more than ``max_patches``, both sides shrink by the same factor (floored), then
    the longer side loses patches until the cap holds.
    """
    if width < 1 or height < 1:
        raise SampleError(f"image has an empty size {width}x{height}")
    rows = max(1, int(height / patch_size + 0.5))
    cols = max(1, int(width / patch_size + 0.5))
    if rows * cols > max_patches:
        scale = math.sqrt(max_patches / (rows * cols))
        rows = max(1, int(rows * scale))
        cols = max(1, int(cols * scale))
        while rows * cols > max_patches:
            if rows >= cols:
                rows -= 1
            else:
                cols -= 1
    return rows, cols


def image_patch_count(width: int, height: int, *, patch_size: int = 16, max_patches: int = 1024) -> int:
    """Number of patches :func:`decode_patches` will produce for a ``width`` x ``height`` image."""
    rows, cols = image_patch_grid(width, height, patch_size=patch_size, max_patches=max_patches)
    return rows * cols


def _describe(exc: Exception) -> str:
    """Exception text without object addresses, so equal failures group under one reason."""
    return f"{type(exc).__name__}: " + re.sub(r"\s*<[^>]*>", "", str(exc))


def image_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from the encoded image's header, without decoding pixels."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return int(im.size[0]), int(im.size[1])
    except Exception as exc:  # Pillow raises UnidentifiedImageError, OSError, ValueError, ...
        raise SampleError(f"cannot read image header: {_describe(exc)}") from exc


def header_patch_count(data: bytes, *, patch_size: int = 16, max_patches: int = 1024) -> int:
    """Patch count of an encoded image from its header alone (metadata without decoding)."""
    width, height = image_size(data)
    return image_patch_count(width, height, patch_size=patch_size, max_patches=max_patches)


def patchify(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """``[rows*p, cols*p, 3]`` pixels → ``[rows*cols, p*p*3]`` patches in row-major grid order."""
    h, w, c = pixels.shape
    rows, cols = h // patch_size, w // patch_size
    grid = pixels.reshape(rows, patch_size, cols, patch_size, c).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(grid.reshape(rows * cols, patch_size * patch_size * c))


def decode_patches(data: bytes, *, patch_size: int = 16, max_patches: int = 1024) -> tuple[np.ndarray, tuple[int, int]]:
    """Decode, resize and patchify one encoded image.

    Returns:
        float32 patches ``[rows*cols, patch_size*patch_size*3]`` normalized with
        :data:`IMAGE_MEAN` / :data:`IMAGE_STD`, and the ``(rows, cols)`` grid (the encoder
        needs it for 2-D position embeddings).

    Raises:
        SampleError: The bytes are not a decodable image.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            rows, cols = image_patch_grid(im.size[0], im.size[1], patch_size=patch_size, max_patches=max_patches)
            target = (cols * patch_size, rows * patch_size)
            # JPEG DCT-domain downscaling: decodes big images several times faster.
            im.draft("RGB", target)
            rgb = im.convert("RGB")
            if rgb.size != target:
                rgb = rgb.resize(target, Image.Resampling.BICUBIC)
            pixels = np.asarray(rgb, dtype=np.float32)
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(f"cannot decode image: {_describe(exc)}") from exc
    pixels = (pixels * np.float32(1.0 / 255.0) - IMAGE_MEAN) / IMAGE_STD
    return patchify(pixels, patch_size), (rows, cols)


def synthetic_jpeg(width: int, height: int, *, seed: int = 0, quality: int = 85) -> bytes:
    """A real JPEG (colour gradient plus blotchy noise) for demos and tests.

    Pixels are generated on a grid 8x coarser and upscaled by Pillow, which keeps thousands
    of demo images cheap while the encoder still sees non-trivial content.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    gh, gw = max(2, height // 8 + 1), max(2, width // 8 + 1)
    y = np.linspace(0.0, 1.0, gh, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, gw, dtype=np.float32)[None, :, None]
    base = rng.uniform(0, 255, size=3).astype(np.float32)
    slope = rng.uniform(-128, 128, size=(2, 3)).astype(np.float32)
    img = base + x * slope[0] + y * slope[1] + rng.normal(0, 24, size=(gh, gw, 3)).astype(np.float32)
    small = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    small.resize((width, height), Image.Resampling.BILINEAR).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
