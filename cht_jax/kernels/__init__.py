"""Faster backends of two operations of the model, called explicitly where the model runs them.

`cpu/`: the C++ kernels of `model.conv_impl` and `model.encoder_impl`
'fused_cpu', imported only in the branch that runs them; they import no model.
"""

from absl import logging
import jax


def resolve(field: str, impl: str, choices: tuple[str, ...], fallback: str) -> str:
  """What `field` = `impl` runs here: 'auto' is 'fused_cpu' on CPU where the kernels
  build, else `fallback`. ValueError for an unknown `impl` or 'fused_cpu' where it cannot run.
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
