"""`Inkling2ImageProcessorPil`: its output format checked by hand from the format's rules, and against transformers'
built-in `Inkling2ImageProcessor` where that one can run. The built-in counts `ceil(W / 40)` columns, one fewer than
tml-renderers (and ours) for widths that are multiples of 40: there it is compared without our extra column.
Image-token counts against tml-renderers itself: tests/processing/test_chat_template.py.

The built-in processor needs torchvision, which cannot be installed beside the CPU torch used here: the comparison
tests are skipped without it (`pytest.importorskip("torchvision")`), and the hand-computed tests below check the
same behaviour everywhere.
"""

import base64
import http.server
import threading
from functools import partial

import numpy as np
import PIL.Image
import pytest
import torch

from transformers_inkling2.processing.image_processing_inkling2 import DEFAULT_MAX_PIXELS, Inkling2ImageProcessorPil

CELL = 40  # patch 20 x merge 2
PADDING = (-1 - 127.5) / 127.5  # -1 on the 0-255 scale, then (x / 255 - 0.5) / 0.5


def normalized(values) -> np.ndarray:
    return (np.asarray(values, dtype=np.float32) - 127.5) / 127.5


def random_rgb(height, width, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def random_pil(height, width, mode="RGB", seed=0) -> PIL.Image.Image:
    channels = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (height, width, channels[mode]), dtype=np.uint8).squeeze(-1 if mode == "L" else ())
    return PIL.Image.fromarray(array, mode)


def unpatchify(pixel_values: torch.Tensor, rows: int, cols: int, channels: int = 3) -> np.ndarray:
    """Blocks `[rows * cols, 40, 40, C]` back to the padded `[rows * 40, cols * 40, C]` image (the inverse rule)."""
    blocks = pixel_values.numpy().reshape(rows, cols, CELL, CELL, channels)
    return blocks.transpose(0, 2, 1, 3, 4).reshape(rows * CELL, cols * CELL, channels)


@pytest.fixture(scope="module")
def processor():
    return Inkling2ImageProcessorPil()


# ---------------------------------------------------------------------------------------------------------------
# Format rules, checked by hand
# ---------------------------------------------------------------------------------------------------------------


def test_tiny_image_padding_and_normalization(processor):
    image = np.array([[[0, 255, 128], [10, 20, 30]], [[255, 0, 1], [100, 200, 50]]], dtype=np.uint8)  # 2x2
    out = processor(image, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 1, 1]]
    pixels = out["pixel_values"]
    assert pixels.shape == (1, CELL, CELL, 3) and pixels.dtype == torch.float32
    np.testing.assert_array_equal(pixels[0, :2, :2].numpy(), normalized(image))
    assert pixels[0, 0, 0].tolist() == [-1.0, 1.0, pytest.approx(0.5 / 127.5)]
    padded = np.ones((CELL, CELL), dtype=bool)
    padded[:2, :2] = False
    assert np.all(pixels[0].numpy()[padded] == np.float32(PADDING))


def test_blocks_are_tokens_in_raster_order_channels_last(processor):
    """Pixel (y, x) encodes its cell in channel 0 and its place inside the cell in channels 1 and 2. The image is
    exactly 2 x 3 cells, so the grid has a fourth column, all padding (tml's rule)."""
    rows, cols = 2, 3
    y, x = np.mgrid[: rows * CELL, : cols * CELL]
    image = np.stack([(y // CELL) * cols + x // CELL, y % CELL, x % CELL], axis=-1).astype(np.uint8)
    out = processor(image, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, rows, cols + 1]]
    values = np.rint(out["pixel_values"].numpy() * 127.5 + 127.5)
    for row in range(rows):
        for col in range(cols):
            token = row * (cols + 1) + col
            assert np.all(values[token, :, :, 0] == row * cols + col)
            assert np.all(values[token, :, :, 1] == np.arange(CELL)[:, None])
            assert np.all(values[token, :, :, 2] == np.arange(CELL)[None, :])
        assert np.all(out["pixel_values"][row * (cols + 1) + cols].numpy() == np.float32(PADDING))


@pytest.mark.parametrize(
    "height, width, grid",
    [
        (1, 1, [1, 1, 1]),
        (40, 40, [1, 1, 2]),  # a width that is a multiple of 40: one extra column, all padding
        (40, 39, [1, 1, 1]),
        (80, 41, [1, 2, 2]),  # heights get no extra row
        (41, 81, [1, 2, 3]),
        (7, 1000, [1, 1, 26]),
        (123, 37, [1, 4, 1]),
    ],
)
def test_grid_and_padding_of_odd_sizes(processor, height, width, grid):
    """`ceil(H / 40)` rows, `W // 40 + 1` columns (tml-renderers' count), the image top left, padding elsewhere."""
    image = random_rgb(height, width)
    out = processor(PIL.Image.fromarray(image), return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [grid]
    canvas = unpatchify(out["pixel_values"], grid[1], grid[2])
    np.testing.assert_array_equal(canvas[:height, :width], normalized(image))
    assert np.all(canvas[height:] == np.float32(PADDING)) and np.all(canvas[:, width:] == np.float32(PADDING))


def test_several_images_are_concatenated_in_order(processor):
    images = [random_rgb(50, 90, seed=1), random_rgb(10, 10, seed=2), random_rgb(81, 40, seed=3)]
    out = processor(images, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 2, 3], [1, 1, 1], [1, 3, 2]]
    assert out["pixel_values"].shape[0] == 6 + 1 + 6
    for image, start, (_, rows, cols) in zip(images, [0, 6, 7], out["image_grid_thw"].tolist(), strict=True):
        canvas = unpatchify(out["pixel_values"][start : start + rows * cols], rows, cols)
        np.testing.assert_array_equal(canvas[: image.shape[0], : image.shape[1]], normalized(image))


def first_block(processor, image) -> np.ndarray:
    """The first token's 40x40 block back on the 0-255 scale."""
    return np.rint(processor(image, return_tensors="pt")["pixel_values"][0].numpy() * 127.5 + 127.5)


def test_transparency_is_composited_on_checkerboard(processor):
    rgba = np.zeros((20, 20, 4), dtype=np.uint8)
    rgba[..., :3] = [255, 0, 100]
    rgba[0, 0, 3] = 0  # fully transparent on a light square
    rgba[0, 8, 3] = 0  # fully transparent on a dark square
    rgba[8, 8, 3] = 0  # light again (checkerboard of 8-pixel squares)
    rgba[1, 1, 3] = 255  # opaque
    rgba[2, 2, 3] = 128  # half: (255*128 + 204*127 + 127) // 255 = 230, (0 + 204*127 + 127) // 255 = 102, ...
    rgba[2, 10, 3] = 64  # on dark: (100*64 + 153*191 + 127) // 255 = 140
    block = first_block(processor, PIL.Image.fromarray(rgba, "RGBA"))
    assert block[0, 0].tolist() == [204, 204, 204]
    assert block[0, 8].tolist() == [153, 153, 153]
    assert block[8, 8].tolist() == [204, 204, 204]
    assert block[1, 1].tolist() == [255, 0, 100]
    assert block[2, 2].tolist() == [230, 102, 152]
    assert block[2, 10, 2] == 140
    # an RGBA array or tensor goes through the same compositing
    np.testing.assert_array_equal(first_block(processor, rgba), block)
    np.testing.assert_array_equal(first_block(processor, torch.from_numpy(rgba).permute(2, 0, 1)), block)


def test_gray_alpha_and_transparent_palette(processor):
    la = PIL.Image.fromarray(np.array([[[77, 0], [77, 255]]], dtype=np.uint8), "LA")  # 1x2
    assert first_block(processor, la)[0, :2].tolist() == [[204, 204, 204], [77, 77, 77]]

    palette = PIL.Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 200, 100, 0] + [0] * 762)
    palette.putpixel((0, 0), 0)
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0  # palette entry 0 is transparent
    assert first_block(processor, palette)[0, :2].tolist() == [[204, 204, 204], [200, 100, 0]]


@pytest.mark.parametrize(
    "make",
    [
        lambda: random_pil(9, 13, "L"),
        lambda: random_pil(9, 13, "RGB").convert("CMYK"),
        lambda: random_pil(9, 13, "RGB").convert("P"),
        lambda: random_pil(9, 13, "L").convert("1"),
    ],
    ids=["L", "CMYK", "P", "1"],  # 16-bit images are scaled instead, which Pillow's convert does not (test_image_depth)
)
def test_other_modes_follow_pillows_rgb_conversion(processor, make):
    image = make()
    expected = np.asarray(image.convert("RGB"))
    np.testing.assert_array_equal(first_block(processor, image)[:9, :13], expected)


def test_grayscale_arrays_are_replicated(processor):
    gray = random_pil(9, 13, "L")
    expected = np.repeat(np.asarray(gray)[..., None], 3, axis=-1)
    array = np.array(gray)
    for image in (gray, array, array[..., None], torch.from_numpy(array), torch.from_numpy(array)[None]):
        np.testing.assert_array_equal(first_block(processor, image)[:9, :13], expected)


def test_without_rgb_conversion_the_channels_stay(processor):
    """`do_convert_rgb=False` keeps an image's channels (transformers' meaning; the suite's 4-channel test): each
    channel normalized with its own mean and std, padding as usual. The model itself needs RGB (its ViT refuses
    other channel counts: test_pipeline.py)."""
    rgba = random_pil(9, 41, "RGBA")
    mean, std = [0.0, 0.25, 0.5, 1.0], [1.0, 0.5, 0.25, 2.0]
    out = processor(rgba, do_convert_rgb=False, image_mean=mean, image_std=std, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 1, 2]] and out["pixel_values"].shape == (2, CELL, CELL, 4)
    canvas = unpatchify(out["pixel_values"], 1, 2, channels=4)
    expected = (np.asarray(rgba, dtype=np.float32) / 255 - np.float32(mean)) / np.float32(std)
    np.testing.assert_allclose(canvas[:9, :41], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(canvas[9:, :, 3], (-1 / 255 - 1.0) / 2.0, rtol=1e-6)
    gray = processor(random_pil(9, 13, "L"), do_convert_rgb=False, image_mean=0.5, image_std=0.5)
    assert gray["pixel_values"].shape == (1, CELL, CELL, 1)


def test_without_rgb_conversion_mismatches_are_clear_errors(processor):
    rgba = random_rgb(9, 13)[..., [0, 1, 2, 0]]
    with pytest.raises(ValueError, match=r"`image_mean` has 3 values but the images have 4 channels.*do_convert_rgb"):
        processor(rgba, do_convert_rgb=False)
    with pytest.raises(ValueError, match="same number of channels, got 4 and 3"):
        processor([rgba, random_rgb(9, 13)], do_convert_rgb=False, image_mean=0.5, image_std=0.5)


def test_array_and_tensor_layouts_agree_with_pil(processor):
    image = random_rgb(45, 17)
    expected = processor(PIL.Image.fromarray(image), return_tensors="pt")["pixel_values"]
    for same in (
        image,
        image.astype(np.float32),  # floats are read on the 0-255 scale
        torch.from_numpy(image),  # HWC
        torch.from_numpy(image).permute(2, 0, 1),  # CHW
        torch.from_numpy(image).permute(2, 0, 1).to(torch.bfloat16),  # exact for integers up to 256
        image.transpose(2, 0, 1),
    ):
        assert torch.equal(processor(same, return_tensors="pt")["pixel_values"], expected)


def test_paths_data_uris_and_urls(processor, tmp_path):
    rgba = random_pil(30, 50, "RGBA")
    expected = processor(rgba, return_tensors="pt")["pixel_values"]
    path = tmp_path / "image.png"
    rgba.save(path)
    encoded = base64.b64encode(path.read_bytes()).decode()

    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/image.png"
        for source in (str(path), path, f"data:image/png;base64,{encoded}", url):
            assert torch.equal(processor(source, return_tensors="pt")["pixel_values"], expected), source
        assert processor([str(path), rgba], return_tensors="pt")["image_grid_thw"].tolist() == [[1, 1, 2]] * 2
    finally:
        server.shutdown()
        server.server_close()


def test_exif_orientation_is_applied(processor, tmp_path):
    image = PIL.Image.fromarray(random_rgb(10, 60))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # rotated: the upright image is 60 tall and 10 wide
    image.save(tmp_path / "rotated.jpg", exif=exif)
    assert processor(str(tmp_path / "rotated.jpg"))["image_grid_thw"].tolist() == [[1, 2, 1]]


def test_return_tensors(processor):
    assert isinstance(processor(random_rgb(5, 5), return_tensors="np")["pixel_values"], np.ndarray)
    assert isinstance(processor(random_rgb(5, 5))["image_grid_thw"], torch.Tensor)


# ---------------------------------------------------------------------------------------------------------------
# Pixel budget
# ---------------------------------------------------------------------------------------------------------------


def test_max_pixels_bounds_tokens_and_keeps_aspect_ratio():
    processor = Inkling2ImageProcessorPil(max_pixels=256 * CELL * CELL)  # 256 tokens
    photo = np.zeros((2000, 1500, 3), dtype=np.uint8)
    grid = processor(photo, return_tensors="pt")["image_grid_thw"][0].tolist()
    assert grid[1] * grid[2] <= 256
    assert grid[1] * grid[2] >= 0.8 * 256  # and close to it: the budget is used
    assert abs(grid[1] / grid[2] - 2000 / 1500) < 0.1
    assert processor.get_number_of_image_patches(2000, 1500) == grid[1] * grid[2]
    # without a budget (max_pixels=None, like the reference processor) nothing is resized
    assert Inkling2ImageProcessorPil(max_pixels=None)(photo)["image_grid_thw"].tolist() == [[1, 50, 38]]


def test_the_default_budget_caps_an_image_at_4096_tokens_and_none_never_resizes(processor):
    assert processor.max_pixels == DEFAULT_MAX_PIXELS == 4096 * CELL * CELL
    assert processor.get_number_of_image_patches(12000, 12000) == 64 * 64  # was 300 x 301 = 90,300
    assert processor.get_number_of_image_patches(12000, 12000, {"max_pixels": None}) == 300 * 301
    assert processor.get_number_of_image_patches(2000, 3000) == 50 * 76  # within the budget: untouched
    grid = processor(np.zeros((3000, 4000, 3), dtype=np.uint8))["image_grid_thw"][0].tolist()
    assert grid[1] * grid[2] <= 4096 and grid == [1, 55, 74]
    assert processor(np.zeros((3000, 4000, 3), dtype=np.uint8), max_pixels=None)["image_grid_thw"].tolist() == [
        [1, 75, 101]
    ]


def test_max_pixels_none_survives_save_and_load(tmp_path):
    Inkling2ImageProcessorPil(max_pixels=None).save_pretrained(tmp_path)
    assert Inkling2ImageProcessorPil.from_pretrained(tmp_path).max_pixels is None


def test_max_pixels_leaves_images_within_budget_untouched(processor):
    image = random_rgb(79, 121)  # 2 x 4 tokens
    plain = processor(image, return_tensors="pt")["pixel_values"]
    assert torch.equal(processor(image, max_pixels=8 * CELL * CELL, return_tensors="pt")["pixel_values"], plain)
    resized = processor(image, max_pixels=7 * CELL * CELL, return_tensors="pt")
    assert resized["image_grid_thw"][0].prod() <= 7


def test_max_pixels_on_very_wide_images(processor):
    grid = processor(random_rgb(8, 4000), max_pixels=10 * CELL * CELL)["image_grid_thw"][0].tolist()
    assert grid == [1, 1, 10]


def test_max_pixels_survives_save_and_load(tmp_path):
    Inkling2ImageProcessorPil(max_pixels=123456).save_pretrained(tmp_path)
    assert Inkling2ImageProcessorPil.from_pretrained(tmp_path).max_pixels == 123456


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


def test_unreadable_images_name_the_source(processor, tmp_path):
    with pytest.raises(ValueError, match="no_such_file.png"):
        processor(str(tmp_path / "no_such_file.png"))
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match="broken.jpg"):
        processor(str(broken))


@pytest.mark.parametrize("bad", [42, {"image": 1}, None, b"bytes"])
def test_unsupported_types(processor, bad):
    with pytest.raises(TypeError, match="Unsupported image type"):
        processor(bad)


@pytest.mark.parametrize(
    "image, message",
    [
        (np.full((4, 4, 3), 1000, dtype=np.uint16), "0-255"),
        (np.zeros((5, 6, 2), dtype=np.uint8), "channel axis"),
        (np.zeros((4, 4, 4, 4, 4), dtype=np.uint8), "HW, HWC or CHW"),
        (np.zeros((4, 4, 3), dtype=bool), "dtype"),
    ],
)
def test_invalid_arrays(processor, image, message):
    with pytest.raises((ValueError, TypeError), match=message):
        processor(image)


def test_invalid_settings(processor):
    with pytest.raises(ValueError, match="at least one 40x40"):
        processor(random_rgb(5, 5), max_pixels=100)
    with pytest.raises(ValueError, match="at least one 40x40"):
        processor.get_number_of_image_patches(50, 50, {"max_pixels": 1599})
    with pytest.raises(ValueError, match="do_convert_rgb"):
        processor(random_pil(5, 5, "L"), do_convert_rgb=False)


# ---------------------------------------------------------------------------------------------------------------
# Against the built-in processor (needs torchvision)
# ---------------------------------------------------------------------------------------------------------------


def builtin_cases():
    rng = np.random.default_rng(7)
    palette_with_transparency = random_pil(21, 33, "RGB", seed=5).convert("P")
    palette_with_transparency.info["transparency"] = 3
    return {
        "rgb odd": random_pil(37, 83),
        "1x1": random_pil(1, 1),
        "very wide": random_pil(3, 1001),
        "very tall": random_pil(413, 9),
        "gray": random_pil(50, 41, "L"),
        "gray+alpha": random_pil(23, 61, "LA"),
        "rgba": random_pil(64, 65, "RGBA"),
        "cmyk": random_pil(30, 20, "RGB").convert("CMYK"),
        "16-bit": PIL.Image.fromarray(rng.integers(0, 65536, (41, 40), dtype=np.uint16)),
        "palette": random_pil(44, 45).convert("P"),
        "palette with transparency": palette_with_transparency,
        "numpy hwc": rng.integers(0, 256, (45, 12, 3), dtype=np.uint8),
        "numpy rgba": rng.integers(0, 256, (17, 90, 4), dtype=np.uint8),
        "tensor chw": torch.randint(0, 256, (3, 81, 50), dtype=torch.uint8),
        "width 80": random_pil(30, 80),
    }


def with_builtin_columns(ours, builtin):
    """Our `pixel_values` and `image_grid_thw` without the extra column where the built-in counts one column fewer
    (widths that are multiples of 40: it rounds up, tml adds a column; docs/images.md); that column must be padding."""
    blocks, grids, start = [], [], 0
    for (_, rows, cols), (_, _, builtin_cols) in zip(
        ours["image_grid_thw"].tolist(), builtin["image_grid_thw"].tolist(), strict=True
    ):
        image = ours["pixel_values"][start : start + rows * cols].reshape(rows, cols, CELL, CELL, 3)
        start += rows * cols
        if cols == builtin_cols + 1:
            assert torch.all(image[:, -1] == np.float32(PADDING))
            image = image[:, :-1]
        blocks.append(image.reshape(-1, CELL, CELL, 3))
        grids.append([1, rows, image.shape[1]])
    return torch.cat(blocks), torch.tensor(grids)


@pytest.fixture(scope="module")
def builtin_processor():
    pytest.importorskip("torchvision")
    from transformers.models.inkling2.image_processing_inkling2 import Inkling2ImageProcessor

    return Inkling2ImageProcessor()


@pytest.mark.parametrize("name", list(builtin_cases()))
def test_matches_builtin_processor(processor, builtin_processor, name):
    image = builtin_cases()[name]
    ours = processor(image, return_tensors="pt")
    expected = builtin_processor(image, return_tensors="pt")
    pixel_values, image_grid_thw = with_builtin_columns(ours, expected)
    assert torch.equal(image_grid_thw, expected["image_grid_thw"])
    assert pixel_values.dtype == expected["pixel_values"].dtype
    assert torch.equal(pixel_values, expected["pixel_values"])


def test_matches_builtin_processor_on_a_batch(processor, builtin_processor):
    images = list(builtin_cases().values())
    ours, expected = processor(images, return_tensors="pt"), builtin_processor(images, return_tensors="pt")
    pixel_values, image_grid_thw = with_builtin_columns(ours, expected)
    assert torch.equal(image_grid_thw, expected["image_grid_thw"])
    assert torch.equal(pixel_values, expected["pixel_values"])
    # the two differ exactly on the widths that are multiples of 40 ("16-bit" is 40 wide, "width 80")
    differ = (ours["image_grid_thw"] != expected["image_grid_thw"]).any(-1)
    assert [name for name, d in zip(builtin_cases(), differ.tolist(), strict=True) if d] == ["16-bit", "width 80"]
