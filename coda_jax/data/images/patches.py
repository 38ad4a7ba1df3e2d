"""Pix2Struct's input: an image as variable-resolution patches (NumPy, Pillow).

Pix2Struct (Lee et al. 2022; google-research/pix2struct, and `transformers`'
`Pix2StructImageProcessor`) reads an image as a sequence of `max_patches`
rows, each a 16 x 16 patch `[row_id, col_id, 768 pixel values]`:

1. standardise the image by its own mean and standard deviation (the
   deviation floored at 1 / sqrt(number of values), so that a blank image is
   not divided by zero);
2. resize it, aspect ratio kept, to the largest grid of `rows x cols` whole
   patches with rows x cols <= max_patches:
   `scale = sqrt(max_patches * p * p / (H * W))`,
   `rows = max(min(floor(scale * H / p), max_patches), 1)`, the same for
   cols; bilinear with antialiasing (Pillow's filter, which torch's
   `interpolate(..., antialias=True)` reproduces);
3. cut the resized image into patches in reading order, each flattened in
   row, column, channel order, prefixed by its 1-based row and column ids;
   the rows past `rows * cols` are zeros (row id 0: padding, which
   `real_patch_mask` tells apart and the encoder never routes).

A VQA question is read as part of the image: `render_header` draws it as a
text header above the image (Pix2Struct's `render_header`: black on white,
wrapped at 80 characters, 5 pixels of padding, both parts resized to the
wider one's width), before the patches are cut.

Public: `grid`, `standardize`, `extract_patches`, `load_image`,
`real_patch_mask`, `render_text`, `render_header`.
"""
from __future__ import annotations

import math
import os
import textwrap
from typing import Optional, Tuple, Union

import numpy as np

from coda_jax.config import PATCH_ID_COLUMNS

PATCH_SIZE = 16
# Row id and column id before each patch's pixel values.
ID_COLUMNS = PATCH_ID_COLUMNS
# Pix2Struct's question header: font size, characters per line, padding.
HEADER_TEXT_SIZE = 36
HEADER_LINE_CHARACTERS = 80
HEADER_PADDING = 5


def grid(height: int, width: int, max_patches: int, patch_size: int = PATCH_SIZE
         ) -> Tuple[int, int]:
  """`(rows, cols)` of whole patches an `height x width` image is resized to."""
  if height < 1 or width < 1:
    raise ValueError(f'an image must have pixels, got {height} x {width}')
  if max_patches < 1:
    raise ValueError(f'max_patches must be at least 1, got {max_patches}')
  scale = math.sqrt(max_patches * (patch_size / height) * (patch_size / width))
  rows = max(min(int(scale * height / patch_size), max_patches), 1)
  cols = max(min(int(scale * width / patch_size), max_patches), 1)
  return rows, cols


def standardize(image: np.ndarray) -> np.ndarray:
  """`[H, W, C]` -> float32, zero mean and unit deviation over all its values
  (the deviation floored at 1 / sqrt(H * W * C))."""
  image = np.asarray(image, np.float32)
  floor = 1.0 / math.sqrt(image.size)
  return (image - image.mean()) / max(float(image.std()), floor)


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """Bilinear, antialiased resize of a float `[H, W, C]` image, channel by
  channel in Pillow's 32-bit float mode."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  if image.shape[:2] == (height, width):
    return image
  channels = [np.asarray(Image.fromarray(np.ascontiguousarray(image[..., c]), mode='F')
                         .resize((width, height), Image.BILINEAR), np.float32)
              for c in range(image.shape[-1])]
  return np.stack(channels, axis=-1)


def extract_patches(image: np.ndarray, max_patches: int, patch_size: int = PATCH_SIZE,
                    normalize: bool = True) -> np.ndarray:
  """An image `[H, W, C]` (uint8 or float) -> `[max_patches, 2 + p * p * C]`
  float32: standardised (`normalize`), resized to `grid`'s patches, each
  row `[row_id, col_id, values...]`, zero rows after the last patch."""
  image = np.asarray(image)
  if image.ndim != 3:
    raise ValueError(f'an image is [height, width, channels], got shape {image.shape}')
  image = standardize(image) if normalize else image.astype(np.float32)
  rows, cols = grid(image.shape[0], image.shape[1], max_patches, patch_size)
  image = _resize(image, rows * patch_size, cols * patch_size)
  channels = image.shape[-1]
  patches = image.reshape(rows, patch_size, cols, patch_size, channels)
  patches = patches.transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
  ids = np.stack(np.meshgrid(np.arange(1, rows + 1), np.arange(1, cols + 1), indexing='ij'),
                 axis=-1).reshape(rows * cols, ID_COLUMNS)
  out = np.zeros((max_patches, ID_COLUMNS + patches.shape[1]), np.float32)
  out[:rows * cols, :ID_COLUMNS] = ids
  out[:rows * cols, ID_COLUMNS:] = patches
  return out


def load_image(image: Union[str, os.PathLike, np.ndarray]) -> np.ndarray:
  """An image file (any format Pillow reads) or array -> uint8 RGB `[H, W, 3]`
  (a grey image repeated over three channels, an alpha channel dropped)."""
  if isinstance(image, np.ndarray):
    array = image
  else:
    from PIL import Image  # pylint: disable=g-import-not-at-top
    with Image.open(image) as opened:
      array = np.asarray(opened.convert('RGB'))
  if array.ndim == 2:
    array = np.repeat(array[..., None], 3, axis=-1)
  if array.ndim != 3 or array.shape[-1] not in (3, 4):
    raise ValueError(f'an image is [height, width, 3 (RGB) or 4 (RGBA)], got shape '
                     f'{array.shape}')
  return array[..., :3]


def real_patch_mask(patches: np.ndarray) -> np.ndarray:
  """`[..., max_patches, 2 + values]` -> bool `[..., max_patches]`: the patches
  of the image, not the padding after them (row id 0)."""
  return np.asarray(patches)[..., 0] > 0


def _font(size: int, font_path: Optional[Union[str, os.PathLike]]):
  """A TrueType font file at `size`, or Pillow's built-in font at `size`
  (no file needed; Pix2Struct itself draws with Arial)."""
  from PIL import ImageFont  # pylint: disable=g-import-not-at-top
  if font_path is None:
    return ImageFont.load_default(size=size)
  if not os.path.exists(font_path):
    raise ValueError(f'font file {str(font_path)!r} does not exist')
  return ImageFont.truetype(str(font_path), encoding='UTF-8', size=size)


def render_text(text: str, text_size: int = HEADER_TEXT_SIZE,
                font_path: Optional[Union[str, os.PathLike]] = None) -> np.ndarray:
  """`text`, wrapped at `HEADER_LINE_CHARACTERS`, black on white with
  `HEADER_PADDING` pixels around it -> uint8 RGB `[H, W, 3]`."""
  from PIL import Image, ImageDraw  # pylint: disable=g-import-not-at-top
  wrapped = '\n'.join(textwrap.TextWrapper(width=HEADER_LINE_CHARACTERS).wrap(text=text))
  font = _font(text_size, font_path)
  _, _, right, bottom = ImageDraw.Draw(Image.new('RGB', (1, 1))).textbbox(
      (0, 0), wrapped, font=font)
  canvas = Image.new('RGB', (right + 2 * HEADER_PADDING, bottom + 2 * HEADER_PADDING), 'white')
  ImageDraw.Draw(canvas).text((HEADER_PADDING, HEADER_PADDING), wrapped, fill='black',
                              font=font)
  return np.asarray(canvas)


def render_header(image: np.ndarray, header: str, text_size: int = HEADER_TEXT_SIZE,
                  font_path: Optional[Union[str, os.PathLike]] = None) -> np.ndarray:
  """uint8 RGB `image [H, W, 3]` with `header` drawn above it (`render_text`):
  both resized (Pillow's bicubic default) to the wider one's width, aspect
  ratios kept, header on top -> `[H', W', 3]`."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  picture = Image.fromarray(load_image(np.asarray(image, np.uint8)))
  text = Image.fromarray(render_text(header, text_size, font_path))
  width = max(text.width, picture.width)
  height = int(picture.height * (width / picture.width))
  header_height = int(text.height * (width / text.width))
  out = Image.new('RGB', (width, height + header_height), 'white')
  out.paste(text.resize((width, header_height)), (0, 0))
  out.paste(picture.resize((width, height)), (0, header_height))
  return np.asarray(out)
