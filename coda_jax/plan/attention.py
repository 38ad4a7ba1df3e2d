"""How an attention call site runs: one plain choice, an `AttentionPlan`.

Five call sites, each given its plan by the program's plan: the encoder's
self-attention (`LayerPlan.attention_plan` of the dense layers), a routed
layer's (`LayerPlan.attention_plan` of the routed ones: k queries over n or
k keys), the decoder's self-attention and its cross-attention
(`DecoderPlan.self_attention_plan`, `.cross_attention_plan`), and beam
search's self-attention (the decoder's self-attention site when it decodes
several beams an example). Formulations, all with the same results:

  einsums, batch_major  XLA's dot-product attention, its two matmul forms
                        (`model.attention.dot_product`); for beam search's
                        self-attention: over a cache reordered at every step
  relpos_kernel         `kernels.relpos_attention`: the encoder's attention,
                        T5's relative position bias computed in the kernel
  decode_kernel         `kernels.decode_attention`: a decoding step's
                        cross-attention over the cached keys/values
  slot_kernel           `kernels.slot_attention`: beam search's self-attention
                        over its cache addressed by slot (never reordered)
  xla_by_slot           the same by XLA (`model.attention.beams.slot_attention`)
  cudnn                 cuDNN's fused attention (`jax.nn.dot_product_attention`,
                        implementation 'cudnn'): the encoder's attention on a
                        GPU, the relative position bias as its bias and the
                        padding as each row's real keys; off a GPU ('interpret')
                        the same call with jax's XLA implementation

`model.attention.run.attend` runs a plan; the layer keeps only its
projections and its cache, and asserts the plan's list of what keeps a
kernel from a call (`plan.blockers`). No flax here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from coda_jax.plan.choose import interpret as interpret_mode
from coda_jax.plan.rules import (ATTENTION, BATCH_MAJOR, BEAM_ATTENTION, CUDNN,
                                 DECODE_ATTENTION, EINSUMS, FUSED_ATTENTION)

RELPOS_KERNEL, DECODE_KERNEL, SLOT_KERNEL, XLA_BY_SLOT = (
    'relpos_kernel', 'decode_kernel', 'slot_kernel', 'xla_by_slot')
FORMULATIONS = (EINSUMS, BATCH_MAJOR, RELPOS_KERNEL, DECODE_KERNEL, SLOT_KERNEL, XLA_BY_SLOT,
                CUDNN)
# The plan's choice (`rules.KERNELS`) each kernel formulation comes from.
KERNEL_OF = {RELPOS_KERNEL: ATTENTION, DECODE_KERNEL: DECODE_ATTENTION,
             SLOT_KERNEL: BEAM_ATTENTION, CUDNN: FUSED_ATTENTION}


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
  """How one attention call site runs.

  Attributes:
    formulation: one of `FORMULATIONS`.
    interpret: its kernel in Pallas interpret mode, or cuDNN's attention as
      jax's XLA implementation (None: as on the chip the program is traced
      for; `plan.choose.interpret`).
  """
  formulation: str = EINSUMS
  interpret: Optional[bool] = None

  def __post_init__(self):
    if self.formulation not in FORMULATIONS:
      raise ValueError(f'AttentionPlan.formulation must be one of {FORMULATIONS}, got '
                       f'{self.formulation!r}')

  @property
  def kernel(self) -> Optional[str]:
    """The plan's choice whose kernel it runs (`rules.KERNELS`), or None (XLA)."""
    return KERNEL_OF.get(self.formulation)

  @property
  def by_slot(self) -> bool:
    """Beam search's cache addressed by slot (`model.attention.beams.SLOTS`),
    not reordered."""
    return self.formulation in (SLOT_KERNEL, XLA_BY_SLOT)

  @property
  def xla_form(self) -> str:
    """XLA attention's matmul form where XLA's dot-product attention runs."""
    return self.formulation if self.formulation in (EINSUMS, BATCH_MAJOR) else EINSUMS

  def interpret_mode(self) -> bool:
    """Whether its kernel runs in Pallas interpret mode."""
    if self.interpret is not None:
      return self.interpret
    return interpret_mode(self.kernel) if self.kernel is not None else True


def of_choice(kernel_formulation: str, chosen: bool, xla_form: str,
              interpret: bool) -> AttentionPlan:
  """The site's plan: `kernel_formulation` where its kernel was chosen, else
  XLA's attention in `xla_form`."""
  return AttentionPlan(kernel_formulation if chosen else xla_form, interpret)
