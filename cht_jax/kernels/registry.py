"""Where a backend's kernel stands in for a named operation of the model.

The model's Python functions are the definitions. One decorated with
`overridable(op, switch, setting)` consults the registry each time it is
traced: where its setting (a config field such as `model.conv_impl`) resolves
to a backend that registered a kernel for `op` (`register`) and the kernel
takes these arguments, the kernel runs; otherwise the definition does, given
the switch's fallback in place of a backend's name. A backend asked for by
name where it cannot run is an error naming the field.

Backends are packages imported on first use (`BACKENDS`): importing the model
neither imports nor builds one.
"""

import dataclasses
import functools
import importlib
import inspect
from typing import Callable

from absl import logging
import jax


@dataclasses.dataclass(frozen=True)
class Backend:
  """A package of kernels for one platform, chosen by its name as a `Switch`'s value."""
  platform: str  # The `jax.default_backend()` it runs on.
  package: str  # Registers its kernels when imported; its `build_error()` says why it cannot run.


# A setting's value that names a backend -> the backend. 'auto' takes the
# first one that runs here.
BACKENDS = {'fused_cpu': Backend('cpu', 'cht_jax.kernels.cpu')}


def build_error(backend: str) -> str | None:
  """Why `backend`'s kernels cannot run on this machine (e.g. no compiler), or None."""
  return importlib.import_module(BACKENDS[backend].package).build_error()


@dataclasses.dataclass(frozen=True)
class Switch:
  """A config field that chooses between the model's definitions and a backend's kernels.

  Attributes:
    field: the field, as messages name it ('model.conv_impl').
    choices: its values: 'auto', backends' names and the definitions' own settings.
    fallback: the definitions' setting that 'auto' stands for where no backend
      runs, and that a definition is given where its kernel does not run.
  """
  field: str
  choices: tuple[str, ...]
  fallback: str

  def resolve(self, impl: str) -> str:
    """What `impl` stands for here: 'auto' resolved, a backend checked, anything else itself.

    Raises:
      ValueError: `impl` is not a choice, or names a backend that cannot run here.
    """
    if impl not in self.choices:
      name = self.field.rsplit('.', 1)[-1]
      raise ValueError(f'Unknown {name} {impl!r}; expected one of {self.choices}.')
    platform = jax.default_backend()
    if impl == 'auto':
      for name, backend in BACKENDS.items():
        if name in self.choices and backend.platform == platform:
          error = build_error(name)
          if error is None:
            return name
          logging.log_first_n(logging.WARNING, "%s='auto': the %s kernels are not available "
                              "(%s); using '%s'.", 1, self.field, name, error, self.fallback)
      return self.fallback
    if impl in BACKENDS:
      if platform != BACKENDS[impl].platform:
        raise ValueError(f"{self.field}='{impl}' runs on {BACKENDS[impl].platform.upper()} "
                         f'only, not on {platform}; use auto or {self.fallback}.')
      error = build_error(impl)
      if error:
        raise ValueError(f"{self.field}='{impl}': {error}")
    return impl


@dataclasses.dataclass(frozen=True)
class _Kernel:
  fn: Callable
  unsupported: Callable[..., str | None]
  forward_only: bool


_KERNELS: dict[tuple[str, str], _Kernel] = {}  # (op, backend) -> kernel.


def register(op: str, backend: str, unsupported: Callable[..., str | None] | None = None,
             forward_only: bool = False) -> Callable:
  """Decorator: the function is `backend`'s kernel for the model's operation `op`.

  It takes the operation's operands: the definition's arguments or, for a
  Flax module's method, (module, params, *call arguments).

  Args:
    op: the name the definition was made `overridable` under.
    backend: a key of `BACKENDS`.
    unsupported: operands -> why the kernel cannot take them, or None (the
      default: it takes everything).
    forward_only: the kernel has no gradient. It runs where nothing
      differentiates the operation; where something does, the definition runs
      (`forward_with_gradient_of`), so its operands must be arrays.
  """
  def add(fn: Callable) -> Callable:
    _KERNELS[op, backend] = _Kernel(fn, unsupported or (lambda *_: None), forward_only)
    return fn
  return add


def registered(backend: str) -> frozenset[str]:
  """The operations `backend` has kernels for."""
  importlib.import_module(BACKENDS[backend].package)
  return frozenset(op for op, name in _KERNELS if name == backend)


def forward_with_gradient_of(fast: Callable, reference: Callable) -> Callable:
  """`fast` where nothing differentiates it; `reference`'s value and VJP where something does.

  For forward-only passes (generating theta to evaluate or deploy) that have a
  faster form with no gradient of its own: training, which differentiates, runs
  exactly `reference`, and forward-only calls get `fast`, equal up to float
  rounding (tested). Both take and return arrays (close over the rest).
  """
  @jax.custom_vjp
  def call(*args):
    return fast(*args)

  call.defvjp(lambda *args: jax.vjp(reference, *args), lambda vjp, grad: vjp(grad))
  return call


def overridable(op: str, switch: Switch, setting: str) -> Callable:
  """Decorator: the function is the Python definition of the operation `op`.

  The operation's operands, which a kernel takes, are the definition's
  arguments, `setting` being `switch.fallback`, or, for a Flax module's method,
  the module's params and the call's arguments.

  Args:
    op: the operation's name, under which backends `register` kernels.
    switch: the config field whose value chooses the implementation.
    setting: the definition's argument holding that value or, where the
      definition is a Flax module's method, the module's attribute.
  """
  def decorate(definition: Callable) -> Callable:
    signature = inspect.signature(definition)
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
           for p in signature.parameters.values()):
      raise TypeError(f'{definition.__qualname__}: overridable definitions take positional '
                      'arguments only (the operands a kernel is given).')
    is_method = setting not in signature.parameters

    @functools.wraps(definition)
    def call(*args, **kwargs):
      bound = signature.bind(*args, **kwargs)
      bound.apply_defaults()
      impl = getattr(args[0], setting) if is_method else bound.arguments[setting]
      backend = switch.resolve(impl)
      if backend not in BACKENDS or (is_method and args[0].is_initializing()):
        return definition(*args, **kwargs)  # Initialising a module creates its params.
      if is_method:  # A function of the module's params and the call's arguments.
        module, *arguments = bound.args
        reference = module.clone(parent=None, **{setting: switch.fallback})
        python = lambda params, *arguments: reference.apply(
            {'params': params}, *arguments, method=definition.__name__)
        operands, owner = (module.variables['params'], *arguments), (module,)
      else:
        bound.arguments[setting] = switch.fallback
        python, operands, owner = definition, bound.args, ()
      kernel = _KERNELS.get((op, backend))
      reason = (kernel.unsupported(*owner, *operands) if kernel
                else f'it has no kernel for {op}')
      if reason and impl == backend:
        raise ValueError(f"{switch.field}='{backend}': {reason}; use auto or {switch.fallback}.")
      if reason:
        return python(*operands)
      fast = functools.partial(kernel.fn, *owner)
      if kernel.forward_only:
        return forward_with_gradient_of(fast, python)(*operands)
      return fast(*operands)

    return call
  return decorate
