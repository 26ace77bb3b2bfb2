"""Faster backends of two operations of the model, called explicitly where the model runs them.

`cpu/` holds C++ kernels for XLA:CPU, the 'fused_cpu' setting of
`model.conv_impl` (the generated CNN's block, `models/cnn.py:conv_block`) and of
`model.encoder_impl` (a whole encoder stack, `models/transformer.py:Encoder`).
Those two places import their kernel inside the branch that runs it: importing
the model imports no kernel, and the library is built only where 'fused_cpu'
runs (`resolve`, `cpu/library.py`). Kernels import nothing of the model: what
they need of it (the BatchNorm epsilon, the encoder's heads) comes as arguments.
"""

from absl import logging
import jax


def resolve(field: str, impl: str, choices: tuple[str, ...], fallback: str) -> str:
  """What the setting `field` = `impl` runs here: 'auto' resolved, 'fused_cpu' checked.

  'auto' is 'fused_cpu' on CPU where the kernels build (once per machine,
  cached), else `fallback`, the model's own form; any other choice is itself.

  Raises:
    ValueError: `impl` is not one of `choices`, or is 'fused_cpu' where it cannot run.
  """
  if impl not in choices:
    raise ValueError(f"Unknown {field.rsplit('.', 1)[-1]} {impl!r}; expected one of {choices}.")
  if impl not in ('auto', 'fused_cpu'):
    return impl
  platform = jax.default_backend()
  if platform != 'cpu':
    if impl == 'auto':
      return fallback
    raise ValueError(f"{field}='fused_cpu' runs on CPU only, not on {platform}; "
                     f'use auto or {fallback}.')
  from cht_jax.kernels.cpu import library  # pylint: disable=g-import-not-at-top
  error = library.build_error()  # Builds and loads the library on first use.
  if error is None:
    return 'fused_cpu'
  if impl == 'fused_cpu':
    raise ValueError(f"{field}='fused_cpu': {error}")
  logging.log_first_n(logging.WARNING, "%s='auto': the fused_cpu kernels are not available "
                      "(%s); using '%s'.", 1, field, error, fallback)
  return fallback
