"""Image processor of Inkling-2-Small, on Pillow + NumPy (no torchvision).

What the ViT expects, and what this produces for each image:

1. RGB. Transparent images are composited onto a grey checkerboard (8-pixel squares of 204 and 153), as in the
   reference processor; grayscale, palette, CMYK, 16-bit, ... go through Pillow's RGB conversion.
2. A downscale that keeps the aspect ratio when the image does not fit the pixel budget (`max_pixels`, by default
   4096 image tokens' worth; `None` never resizes, like the reference processor).
3. Padding to the token grid (40 pixels a token: patch 20 x merge 2) with the value -1 on the 0-255 scale, just
   below black: the bottom up to a multiple of 40, the right always by at least one pixel. The grid is
   `ceil(H / 40)` rows by `W // 40 + 1` columns, as Thinking Machines' renderer (tml-renderers) counts image
   tokens: a width that is a multiple of 40 gets one whole extra column of padding (docs/images.md).
4. Rescale to [0, 1] and normalise with mean 0.5, std 0.5.
5. One `40 x 40 x 3` block per text image token, tokens in raster order: `pixel_values` of shape
   `[image tokens, 40, 40, 3]` for all images together, and `image_grid_thw` = `[1, token rows, token cols]`
   per image.

The built-in `transformers` `Inkling2ImageProcessor` does the same on torchvision, except for the extra column (it
counts `ceil(W / 40)` columns, one fewer than tml for widths that are multiples of 40); ours needs only Pillow and
NumPy.
It carries the same class name, which checkpoints write as `image_processor_type`: importing this package registers
it for both of transformers' backends, so that the name resolves to it (`Inkling2ImageProcessorPil` is an alias).
"""

from __future__ import annotations

import base64
import io
import math
import os
import urllib.request

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch
import torch.nn.functional as F
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import ChannelDimension, SizeDict, infer_channel_dimension_format, is_valid_image
from transformers.processing_utils import ImagesKwargs, Unpack
from transformers.utils import logging

logger = logging.get_logger(__name__)

# The format's "black" padding, on the 0-255 scale before rescaling and normalisation: (-1/255 - 0.5) / 0.5 =
# -1.0078, just below black (-1.0), as the format's reference implementations pad (docs/images.md)
PAD_VALUE = -1.0
CHECKER_SQUARE = 8
CHECKER_LIGHT, CHECKER_DARK = 204, 153
URL_TIMEOUT_S = 30
# The library's default pixel budget: 4096 image tokens of 40x40 pixels (6,553,600 pixels). Without one, a
# 12000x12000 PNG became 90,000 image tokens (now 64x64 = 4096, at 2534x2534); a 3000x2000 photo (3800 tokens) is
# left as it is, a 4000x3000 one (7575) becomes 2926x2194 (4070).
DEFAULT_MAX_PIXELS = 4096 * 40 * 40


class Inkling2ImageProcessorKwargs(ImagesKwargs, total=False):
    r"""
    max_pixels (`int` or `None`, *optional*, defaults to `DEFAULT_MAX_PIXELS` = 4096 * 1600 = 6,553,600):
        Pixel budget per image, counted on the padded canvas (a whole number of 40x40 cells), so an image yields at
        most `max_pixels // 1600` image tokens (4096 by default). Larger images are downscaled (aspect ratio kept,
        bicubic with antialiasing); images within the budget are never changed. `None`, passed explicitly, never
        resizes, like the reference processor (and tml-renderers): a 4000x3000 photo then costs 7575 image tokens.
    """

    max_pixels: int | None


# ----------------------------------------------------------------------------------------------------------------
# Loading and RGB conversion
# ----------------------------------------------------------------------------------------------------------------


def load_image(source: str | os.PathLike) -> PIL.Image.Image:
    """Open a local path, an http(s) URL or a base64 `data:image/...` URI as an upright PIL image.

    Unlike transformers' `load_image`, the alpha channel is kept, so transparent images are composited the same way
    whether they arrive as a path or as a PIL image.

    For trusted input only: it opens any path and fetches any URL. `inkling2 serve` loads what clients send with
    `transformers_inkling2.serving.media.load_media_image`, which enforces a `MediaPolicy`.
    """
    source = os.fspath(source)
    try:
        if source.startswith(("http://", "https://")):
            request = urllib.request.Request(source, headers={"User-Agent": "transformers-inkling2"})
            with urllib.request.urlopen(request, timeout=URL_TIMEOUT_S) as response:
                data = io.BytesIO(response.read())
        elif source.startswith("data:image/"):
            data = io.BytesIO(base64.b64decode(source.split(",", 1)[1]))
        elif os.path.isfile(source):
            data = source
        else:
            raise FileNotFoundError("no such file, and not an http(s) URL or a data:image/ URI")
        image = PIL.Image.open(data)
        image.load()
    except Exception as error:
        shown = source if len(source) <= 200 else source[:200] + "..."
        raise ValueError(f"Could not read an image from {shown!r}: {error}") from error
    return PIL.ImageOps.exif_transpose(image)


# Pillow's modes for more than 8 bits a channel (16-bit grayscale PNGs open as "I;16"; "I" holds the same range)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def to_eight_bits(image: PIL.Image.Image) -> PIL.Image.Image:
    """A 16-bit grayscale image scaled to 8 bits (`value * 255 / 65535`, rounded); Pillow's own `convert` clips
    every value above 255 to white. Other images are returned as they are."""
    if image.mode not in SIXTEEN_BIT_MODES:
        return image
    values = np.asarray(image, dtype=np.int64).clip(0, 65535)
    return PIL.Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), mode="L")


def checkerboard(height: int, width: int) -> np.ndarray:
    """The `[height, width]` background that transparent pixels are composited onto."""
    rows = np.arange(height)[:, None] // CHECKER_SQUARE
    cols = np.arange(width)[None, :] // CHECKER_SQUARE
    return np.where((rows + cols) % 2 == 0, CHECKER_LIGHT, CHECKER_DARK)


def composite_on_checkerboard(rgba: np.ndarray) -> np.ndarray:
    """`[4, H, W]` RGBA on the 0-255 scale -> `[3, H, W]` RGB.

    Integer images are blended with rounding in integer arithmetic (bit-exact with the reference); float images
    (also on the 0-255 scale) are blended in float.
    """
    background = checkerboard(*rgba.shape[1:])
    if np.issubdtype(rgba.dtype, np.integer):
        rgba = rgba.astype(np.int64)
        alpha = rgba[3:4]
        return ((rgba[:3] * alpha + background * (255 - alpha) + 127) // 255).astype(np.uint8)
    alpha = rgba[3:4]
    return (rgba[:3] * alpha + background * (255 - alpha)) / 255


def to_channels_first(array: np.ndarray, input_data_format: str | ChannelDimension | None) -> np.ndarray:
    """HW, HWC or CHW -> CHW."""
    if array.ndim == 2:
        return array[None]
    if array.ndim != 3:
        raise ValueError(f"An image must have 2 or 3 dimensions (HW, HWC or CHW), got shape {array.shape}.")
    if input_data_format is None:
        try:
            input_data_format = infer_channel_dimension_format(array, num_channels=(1, 3, 4))
        except ValueError:
            raise ValueError(
                f"Cannot tell the channel axis of an image of shape {array.shape}: expected 1, 3 or 4 channels in "
                "the first or the last axis (pass `input_data_format` if the layout is unusual)."
            ) from None
    if ChannelDimension(input_data_format) == ChannelDimension.LAST:
        array = np.moveaxis(array, -1, 0)
    return array


def check_pixel_range(array: np.ndarray) -> None:
    """Integer images must be 8-bit valued: other ranges would be silently mis-scaled by the 1/255 rescale."""
    is_number = np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    if array.dtype == np.bool_ or not is_number:
        raise TypeError(f"Unsupported image dtype {array.dtype}: use uint8 (0-255) or floats.")
    if np.issubdtype(array.dtype, np.integer) and array.size and (array.min() < 0 or array.max() > 255):
        raise ValueError(
            f"Integer image values must lie in 0-255, got {array.min()}-{array.max()} ({array.dtype}); convert "
            "16-bit images to 8 bits first (e.g. pass the PIL image, which Pillow converts)."
        )


# ----------------------------------------------------------------------------------------------------------------
# Geometry and numerics
# ----------------------------------------------------------------------------------------------------------------


def grid_size(height: int, width: int, cell_height: int, cell_width: int) -> tuple[int, int]:
    """Token rows and columns of an image: the height rounded up to whole cells; the width plus at least one pixel
    of padding, in whole cells (`width // cell_width + 1`), which is how tml-renderers counts the official format's
    tokens (an exact multiple of the cell width gets one extra column, all padding)."""
    return math.ceil(height / cell_height), width // cell_width + 1


def fit_to_pixel_budget(height: int, width: int, max_pixels: int, cell_height: int, cell_width: int) -> tuple[int, int]:
    """About the largest size with the image's aspect ratio whose padded canvas holds at most `max_pixels` pixels
    (`max_pixels // (cell_height * cell_width)` tokens); an image already within the budget keeps its size."""
    max_tokens = max_pixels // (cell_height * cell_width)
    if max_tokens < 1:
        raise ValueError(f"`max_pixels` ({max_pixels}) must allow at least one {cell_height}x{cell_width} image token.")
    rows, cols = grid_size(height, width, cell_height, cell_width)
    if rows * cols <= max_tokens:
        return height, width
    # Start from the exact area ratio, then shrink until the rounding up to whole cells fits too
    scale = math.sqrt(max_pixels / (height * width))
    while True:
        new_height, new_width = max(1, math.floor(height * scale)), max(1, math.floor(width * scale))
        rows, cols = grid_size(new_height, new_width, cell_height, cell_width)
        if rows * cols <= max_tokens:
            return new_height, new_width
        scale *= 0.99


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bicubic, antialiased resize of a `[C, H, W]` image, kept within its original value range."""
    tensor = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32))[None]
    resized = F.interpolate(tensor, size=(height, width), mode="bicubic", antialias=True, align_corners=False)[0]
    return resized.clamp(float(image.min()), float(image.max())).numpy()


def rescale_and_normalize(
    image: np.ndarray,
    do_rescale: bool,
    rescale_factor: float,
    do_normalize: bool,
    image_mean: float | tuple[float, ...],
    image_std: float | tuple[float, ...],
) -> np.ndarray:
    """`(image * rescale_factor - mean) / std` on a float32 `[C, H, W]` image.

    With both steps on, the rescale is folded into the mean and std (`(x - mean / f) / (std / f)`), in float32, as
    the reference does, so the results agree to the bit.
    """
    if not do_normalize:
        return image * np.float32(rescale_factor) if do_rescale else image
    mean = np.asarray(image_mean, dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(image_std, dtype=np.float32).reshape(-1, 1, 1)
    if do_rescale:
        mean, std = mean * np.float32(1 / rescale_factor), std * np.float32(1 / rescale_factor)
    return (image - mean) / std


def to_token_blocks(image: np.ndarray, cell_height: int, cell_width: int) -> np.ndarray:
    """Padded `[C, rows * ch, cols * cw]` -> `[rows * cols, ch, cw, C]`: one block per token, raster order."""
    channels, height, width = image.shape
    rows, cols = height // cell_height, width // cell_width
    blocks = image.reshape(channels, rows, cell_height, cols, cell_width).transpose(1, 3, 2, 4, 0)
    return blocks.reshape(rows * cols, cell_height, cell_width, channels)


# ----------------------------------------------------------------------------------------------------------------
# The processor
# ----------------------------------------------------------------------------------------------------------------


class Inkling2ImageProcessor(PilBackend):
    r"""
    Turns images into Inkling2's `pixel_values` (`[image tokens, 40, 40, 3]`, float32) and `image_grid_thw`
    (`[images, 3]`, `[1, token rows, token cols]`), without torchvision.

    Accepts PIL images, NumPy arrays and torch tensors (HW, HWC or CHW; uint8, or floats on the 0-255 scale), file
    paths, http(s) URLs and base64 `data:image/` URIs, alone or in (nested) lists.

    Args:
        size (`dict`, defaults to `{"height": 40, "width": 40}`): pixels per image token (patch size x merge size).
        max_pixels (`int` or `None`, defaults to `DEFAULT_MAX_PIXELS`, 4096 tokens' worth): see
            `Inkling2ImageProcessorKwargs`; `None` never resizes.
        do_convert_rgb (`bool`, defaults to `True`): RGB, which the model needs. `False` keeps each image's own
            channels (as transformers' processors do), for inspecting or for other models: `image_mean` and
            `image_std` then need one value per channel (or one for all), and the model's ViT refuses anything but 3.
        do_rescale, rescale_factor, do_normalize, image_mean, image_std: as usual in transformers.
    """

    valid_kwargs = Inkling2ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    do_convert_rgb = True
    do_rescale = True
    do_normalize = True
    size = {"height": 40, "width": 40}
    max_pixels = DEFAULT_MAX_PIXELS

    def __init__(self, **kwargs: Unpack[Inkling2ImageProcessorKwargs]):
        super().__init__(**kwargs)

    def fetch_images(self, images):
        """Open paths, URLs and data URIs (keeping alpha); pass images through; reject anything else."""
        if isinstance(images, (list, tuple)):
            return [self.fetch_images(image) for image in images]
        if isinstance(images, (str, os.PathLike)):
            return load_image(images)
        if isinstance(images, (np.ndarray, torch.Tensor)):
            if images.ndim == 2:  # grayscale HW: give it a leading channel axis, which cannot be misread
                return images[None]
            if images.ndim not in (3, 4):
                raise ValueError(
                    f"An image array must be HW, HWC or CHW (or a batch of those), got shape {tuple(images.shape)}."
                )
            return images
        if is_valid_image(images):
            return images
        raise TypeError(
            f"Unsupported image type {type(images).__name__}: pass PIL images, NumPy arrays, torch tensors, file "
            "paths, http(s) URLs or data:image/ URIs (or lists of them)."
        )

    def process_image(
        self,
        image,
        do_convert_rgb: bool | None = None,
        input_data_format: str | ChannelDimension | None = None,
        **kwargs,
    ) -> np.ndarray:
        """One input image -> `[C, H, W]` array (uint8 for PIL input), RGB when `do_convert_rgb`."""
        if isinstance(image, PIL.Image.Image):
            image = to_eight_bits(image)
            if do_convert_rgb:
                # keep transparency so that it is composited onto the checkerboard below, not dropped
                image = image.convert("RGBA" if image.has_transparency_data else "RGB")
            array, input_data_format = np.array(image), ChannelDimension.LAST
        elif isinstance(image, torch.Tensor):
            image = image.detach().cpu()
            array = (image.float() if image.dtype in (torch.bfloat16, torch.float16) else image).numpy()
        elif isinstance(image, np.ndarray):
            array = image
        else:
            raise TypeError(f"Unsupported image type {type(image).__name__}.")

        check_pixel_range(array)
        array = to_channels_first(array, input_data_format)
        if do_convert_rgb:
            channels = array.shape[0]
            if channels == 1:
                array = np.repeat(array, 3, axis=0)
            elif channels == 4:
                array = composite_on_checkerboard(array)
            elif channels != 3:
                raise ValueError(f"Cannot convert an image with {channels} channels to RGB.")
        return array

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Image tokens that an image of `height x width` pixels becomes (what `image_grid_thw.prod()` will say)."""
        images_kwargs = images_kwargs or {}
        size = images_kwargs.get("size") or self.size
        cell_height, cell_width = size["height"], size["width"]
        max_pixels = images_kwargs.get("max_pixels", self.max_pixels)
        if max_pixels is not None:
            height, width = fit_to_pixel_budget(height, width, max_pixels, cell_height, cell_width)
        rows, cols = grid_size(height, width, cell_height, cell_width)
        return rows * cols

    def _preprocess(
        self,
        images: list[np.ndarray],
        size: SizeDict,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: float | tuple[float, ...],
        image_std: float | tuple[float, ...],
        max_pixels: int | None = None,
        return_tensors=None,
        **kwargs,
    ) -> BatchFeature:
        if not images:
            raise ValueError("No images to process: pass at least one image.")
        cell_height, cell_width = size.height, size.width
        channels = images[0].shape[0]
        for name, values in (("image_mean", image_mean), ("image_std", image_std)):
            count = np.size(values)
            if do_normalize and count not in (1, channels):
                raise ValueError(
                    f"`{name}` has {count} values but the images have {channels} channels: keep "
                    "`do_convert_rgb=True` for the RGB the model needs, or pass one value per channel."
                )
        blocks, image_grid_thw = [], []
        for image in images:
            if image.shape[0] != channels:
                raise ValueError(
                    f"Images of one call must have the same number of channels, got {channels} and "
                    f"{image.shape[0]}: keep `do_convert_rgb=True` (all RGB), or process them separately."
                )
            _, height, width = image.shape
            if do_rescale and np.issubdtype(image.dtype, np.floating) and image.size and image.max() <= 1.0:
                logger.warning_once(
                    "A float image has all values <= 1 but is rescaled by 1/255: floats are read on the 0-255 "
                    "scale. For images in [0, 1], pass `do_rescale=False`."
                )
            if max_pixels is not None:
                new_height, new_width = fit_to_pixel_budget(height, width, max_pixels, cell_height, cell_width)
                if (new_height, new_width) != (height, width):
                    image, height, width = resize(image, new_height, new_width), new_height, new_width

            rows, cols = grid_size(height, width, cell_height, cell_width)
            padding = ((0, 0), (0, rows * cell_height - height), (0, cols * cell_width - width))
            image = np.pad(image.astype(np.float32), padding, constant_values=PAD_VALUE)
            image = rescale_and_normalize(image, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
            blocks.append(to_token_blocks(image.astype(np.float32), cell_height, cell_width))
            image_grid_thw.append([1, rows, cols])

        data = {
            "pixel_values": torch.from_numpy(np.concatenate(blocks)),
            "image_grid_thw": torch.tensor(image_grid_thw, dtype=torch.long),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)


# transformers names an image processor class by its backend (`...Pil`); ours has one backend, and checkpoints name
# it `Inkling2ImageProcessor`
Inkling2ImageProcessorPil = Inkling2ImageProcessor

__all__ = ["DEFAULT_MAX_PIXELS", "Inkling2ImageProcessor", "Inkling2ImageProcessorKwargs", "Inkling2ImageProcessorPil"]
