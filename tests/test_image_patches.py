"""Pix2Struct's patches (`coda_jax.data.images.patches`) against `transformers`'
processor, on images of three aspect ratios written here."""
import numpy as np
import pytest

from coda_jax.data.images import patches as image_patches


def _image(height, width, seed):
  """Smooth colour gradients with noise and a dark block: every resize
  filter weight matters."""
  rng = np.random.RandomState(seed)
  y, x = np.mgrid[:height, :width]
  base = np.stack([255 * x / width, 255 * y / height, 128 + 100 * np.sin(x / 7.0 + y / 11.0)],
                  axis=-1)
  image = base + rng.normal(0, 20, base.shape)
  image[height // 4:height // 2, width // 3:width // 2] = 10
  return np.clip(image, 0, 255).astype(np.uint8)


@pytest.mark.parametrize('height,width,max_patches', [(120, 360, 64), (360, 120, 64),
                                                      (257, 193, 256)])
def test_patches_equal_the_transformers_processor(height, width, max_patches):
  transformers = pytest.importorskip('transformers')
  image = _image(height, width, seed=height)
  processor = transformers.Pix2StructImageProcessor()
  want = processor(images=image, max_patches=max_patches,
                   return_tensors='np')['flattened_patches'][0]
  got = image_patches.extract_patches(image, max_patches)
  assert got.shape == want.shape == (max_patches, 2 + 16 * 16 * 3)
  np.testing.assert_array_equal(got[:, :2], want[:, :2])          # row and column ids
  np.testing.assert_allclose(got[:, 2:], want[:, 2:], rtol=0, atol=1e-4)
  rows, cols = image_patches.grid(height, width, max_patches)
  real = image_patches.real_patch_mask(got)
  assert real.sum() == rows * cols and real[:rows * cols].all()
  assert not got[rows * cols:].any()                              # padding rows are zeros


def test_grid_keeps_the_aspect_ratio_within_max_patches():
  # The generated task's canvas: an exact 8 x 32 grid, no resampling.
  assert image_patches.grid(128, 512, 256) == (8, 32)
  assert image_patches.grid(512, 128, 256) == (32, 8)
  assert image_patches.grid(10, 10_000, 16) == (1, 16)            # at least one row
  for h, w, m in ((480, 640, 2048), (1000, 37, 4096), (16, 16, 1)):
    rows, cols = image_patches.grid(h, w, m)
    assert 1 <= rows * cols <= m


def test_images_load_as_rgb_and_bad_ones_are_named(tmp_path):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  rgba = np.zeros((20, 30, 4), np.uint8)
  rgba[..., 0], rgba[..., 3] = 200, 255
  Image.fromarray(rgba, 'RGBA').save(tmp_path / 'a.png')
  Image.fromarray(np.full((20, 30), 77, np.uint8), 'L').save(tmp_path / 'grey.png')
  loaded = image_patches.load_image(tmp_path / 'a.png')
  assert loaded.shape == (20, 30, 3) and loaded.dtype == np.uint8 and loaded[0, 0, 0] == 200
  assert (image_patches.load_image(tmp_path / 'grey.png') == 77).all()
  assert image_patches.load_image(rgba).shape == (20, 30, 3)
  with pytest.raises(ValueError, match=r'\[height, width, 3 \(RGB\) or 4 \(RGBA\)\]'):
    image_patches.load_image(np.zeros((4, 4, 2), np.uint8))
  with pytest.raises(ValueError, match='max_patches must be at least 1'):
    image_patches.extract_patches(loaded, 0)
  # A blank image: the deviation's floor, no division by zero.
  blank = image_patches.extract_patches(np.full((32, 32, 3), 255, np.uint8), 4)
  assert np.isfinite(blank).all() and not blank[:, 2:].any()


DEJAVU = '/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf'


@pytest.mark.parametrize('height,width,question', [
    (60, 200, 'What is the title of this book?'),
    (300, 90, 'Who wrote it? ' * 9),                     # wraps over two lines
])
def test_the_question_header_equals_the_transformers_processor(height, width, question):
  transformers = pytest.importorskip('transformers')
  import os  # pylint: disable=g-import-not-at-top
  if not os.path.exists(DEJAVU):
    pytest.skip(f'no font file at {DEJAVU} to give both renderers')
  from transformers.models.pix2struct import image_processing_pil_pix2struct as hf
  image = _image(height, width, seed=width)
  want = hf.Pix2StructImageProcessorPil().render_header(
      image.transpose(2, 0, 1), question, font_path=DEJAVU).transpose(1, 2, 0)
  got = image_patches.render_header(image, question, font_path=DEJAVU)
  assert got.shape == want.shape and got.shape[1] >= width
  np.testing.assert_array_equal(got, want)
  # The header is above the image: its top rows are white, with ink.
  assert got.shape[0] > height * got.shape[1] // width
  assert (got[:5] == 255).all() and (got[:got.shape[0] - height] < 128).any()


def test_the_header_draws_without_a_font_file():
  image = np.full((40, 100, 3), 255, np.uint8)
  out = image_patches.render_header(image, 'what?', text_size=16)
  assert out.dtype == np.uint8 and out.shape[1] == 100 and out.shape[0] > 40
  assert (out < 128).any()                                        # the question's ink
  with pytest.raises(ValueError, match='font file'):
    image_patches.render_header(image, 'what?', font_path='/no/such/font.ttf')
