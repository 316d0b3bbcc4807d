"""Images deeper than 8 bits a channel are scaled, not clipped to white."""

import io

import numpy as np
import PIL.Image

from transformers_inkling2 import Inkling2ImageProcessorPil


def sixteen_bit_png(values: np.ndarray) -> PIL.Image.Image:
    buffer = io.BytesIO()
    PIL.Image.fromarray(values.astype(np.uint16)).save(buffer, format="PNG")
    return PIL.Image.open(io.BytesIO(buffer.getvalue()))


def test_a_16_bit_png_is_scaled_to_8_bits():
    ramp = np.linspace(0, 65535, 80 * 80).reshape(80, 80).round()
    image = sixteen_bit_png(ramp)
    assert image.mode == "I;16"
    pixels = Inkling2ImageProcessorPil().process_image(image, do_convert_rgb=True)
    assert pixels.shape == (3, 80, 80) and pixels.dtype == np.uint8
    np.testing.assert_array_equal(pixels[0], np.round(ramp * 255 / 65535).astype(np.uint8))
    assert (pixels == 255).mean() < 0.01  # Pillow's plain convert("RGB") turned 99.6% of this ramp white


def test_the_16_bit_image_gives_the_features_of_its_8_bit_twin():
    ramp = np.linspace(0, 65535, 80 * 120).reshape(80, 120).round()
    twin = PIL.Image.fromarray(np.round(ramp * 255 / 65535).astype(np.uint8), mode="L")
    processor = Inkling2ImageProcessorPil()
    deep, shallow = processor(images=[sixteen_bit_png(ramp)]), processor(images=[twin])
    np.testing.assert_array_equal(np.asarray(deep["pixel_values"]), np.asarray(shallow["pixel_values"]))
    np.testing.assert_array_equal(np.asarray(deep["image_grid_thw"]), np.asarray(shallow["image_grid_thw"]))
