"""Figure 6's numbers on images (`coda_jax.data.images.routing_maps`): what each routed
layer of an image model keeps, its weights on the image's grid, and how
often it keeps ink."""
import jax
import numpy as np
import pytest

from coda_jax.data.images import patches as image_patches
from coda_jax.data.images import routing_maps as image_routing
from coda_jax.data.images import tasks as image_tasks
from coda_jax.model import params as params_lib
from coda_jax.config import CodaConfig, T5Config
from coda_jax.model.network import Transformer

CONFIG = T5Config(vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=16,
                  num_encoder_layers=2, num_decoder_layers=1, encoder_input='patches',
                  patch_dim=768, patch_positions=64, mlp_activations=('gelu', 'linear'),
                  logits_via_embedding=False)


def _patches():
  """A generated image (4 x 32 patches, its string 4-6 of them) and a wide
  one with padding rows after its patches."""
  example = image_tasks.read_text(np.random.default_rng(5))
  full = image_tasks.example_patches('', example['scene'], '', 128)
  padded = image_patches.extract_patches(image_tasks.draw_scene(example['scene'])[:, :200],
                                         128)
  return np.stack([full, padded]), example


def test_maps_are_what_the_routers_sow_and_never_padding():
  patches, _ = _patches()
  model = Transformer(CONFIG, coda=CodaConfig(reduction_factor=4))
  params = params_lib.init_params(model, jax.random.PRNGKey(0))
  maps = image_routing.routing_maps(model, params, patches)
  assert [m.layer for m in maps] == ['encoder/layers_0', 'encoder/layers_1']
  _, state = model.apply({'params': params}, patches, enable_dropout=False,
                         method=model.encode, mutable=['intermediates'])
  real = patches[..., 0] > 0
  assert real[1].sum() == 6 * 20 and not real[1, 120:].any()  # 6 x 20 patches, 8 padding
  for m in maps:
    sown = state['intermediates']['encoder'][m.layer.split('/')[1]]['routing'][0]
    np.testing.assert_array_equal(np.flatnonzero(m.kept[0]), np.asarray(sown['indices'][0]))
    assert m.kept.sum(axis=1).tolist() == [32, 32]           # k = 128 / 4
    assert not (m.kept[1] & ~real[1]).any()                  # no padding kept
    np.testing.assert_allclose(m.weights, np.asarray(sown['weights']), rtol=1e-6)
  with pytest.raises(ValueError, match='routing_maps takes an image model'):
    image_routing.routing_maps(Transformer(T5Config(), coda=CodaConfig()), params, patches)


def test_ink_and_its_report():
  patches, example = _patches()
  inked = image_routing.ink(patches)
  np.testing.assert_array_equal(inked[0], image_tasks.ink_patches(example['scene']))
  real = patches[..., 0] > 0
  kept = np.zeros_like(real)
  kept[0, np.flatnonzero(inked[0])[:2]] = True                # 2 ink patches
  kept[0, np.flatnonzero(~inked[0])[:2]] = True               # 2 blank ones
  report = image_routing.ink_report(kept[:1], inked[:1], real[:1])
  share = inked[0].sum() / 128
  assert report == pytest.approx({'kept_ink_share': 0.5, 'ink_share': share,
                                  'ink_ratio': 0.5 / share})
  assert image_routing.ink_report(kept[:1], np.zeros_like(kept[:1]), real[:1])['ink_ratio'] == 0


def test_grid_puts_values_where_their_patch_is():
  patches, example = _patches()
  values = np.arange(128, dtype=np.float32)
  grid = image_routing.grid(patches[0], values)
  assert grid.shape == (4, 32) and grid[1, 3] == 32 + 3        # reading order
  wide = image_routing.grid(patches[1], values)
  assert wide.shape == (6, 20) and not np.isnan(wide).any()
  [item] = __import__('json').loads(example['scene'])
  ink_grid = image_routing.grid(patches[0], image_tasks.ink_patches(example['scene']), fill=0)
  assert ink_grid[item['row'], item['column']] == 1
