"""Data parallelism: the devices a batch is split over (on CPU, one per core) and the
mean gradient over them.

XLA:CPU runs this model's thousands of small operations one after another,
each on few threads, so one CPU device leaves cores idle. Made one device per
core (`use_cpu_cores`), the same data-parallel step as on GPUs gives each core
its own share of the episodes: 1.15-1.35x more episodes/s at 8-32 episodes per
step on 2 cores (docs/performance.md).
"""

import os

import jax
from jax import flatten_util
import jax.numpy as jnp

_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def cpu_cores() -> int:
  """Cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not on Linux.
    return os.cpu_count() or 1


def use_cpu_cores() -> bool:
  """Makes the CPU backend one device per core, unless XLA_FLAGS sets the count.

  Call before any JAX operation (it cannot change an initialised backend, and
  then only says so). Has no effect on which backend is the default: on a GPU
  or TPU host the accelerators are still the devices used. Returns whether it
  set the count.
  """
  if _DEVICE_COUNT_FLAG in os.environ.get('XLA_FLAGS', ''):
    return False
  try:
    jax.config.update('jax_num_cpu_devices', cpu_cores())
  except RuntimeError:  # Backends already initialised (e.g. called in-process twice).
    return False
  return True


def num_data_devices(batch_size: int | None = None) -> int:
  """Devices a batch of `batch_size` episodes is split over.

  All devices on accelerators and across processes (the batch must be a
  multiple of their number: config validation says so). On one CPU process,
  where the devices are cores, the largest number that divides the batch, so
  that any batch size runs (1 episode per step on one core).
  """
  count = jax.device_count()
  if batch_size is None or jax.default_backend() != 'cpu' or jax.process_count() > 1:
    return count
  return max(n for n in range(1, count + 1) if batch_size % n == 0)


def data_mesh(batch_size: int | None = None) -> jax.sharding.Mesh:
  """A 1-D mesh over `num_data_devices(batch_size)` devices; batches split along 'data'."""
  devices = jax.devices()[:num_data_devices(batch_size)]
  return jax.make_mesh((len(devices),), ('data',), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))


def batch_grads(loss_fn, params, episodes, mesh: jax.sharding.Mesh, vectorize: bool):
  """Mean gradient and metrics of `loss_fn(params, episode) -> (loss, metrics)` over a batch.

  The batch [B, ...] is split over the devices of `mesh` (axis 'data',
  `shard_map`): each device takes its B / devices episodes and the means are
  averaged across devices (`pmean`), as in evaluation. Explicit per-device
  code rather than a sharded vmap: XLA's partitioner would gather the whole
  batch onto every device around custom calls (`model.conv_impl='fused_cpu'`).
  On a device the episodes are vmapped when `vectorize`, else looped
  (`lax.scan` summing the gradients): on CPU one episode at a time stays in
  cache, where a vmapped batch of generated CNNs does not (docs/performance.md).
  """
  def device_grads(params, row):
    size = jax.tree.leaves(row)[0].shape[0]
    if vectorize:
      def mean_loss(p):
        _, metrics = jax.vmap(lambda episode: loss_fn(p, episode))(row)
        metrics = jax.tree.map(jnp.mean, metrics)
        return metrics['loss'], metrics
      grads, metrics = jax.grad(mean_loss, has_aux=True)(params)
    else:
      grad_fn = jax.grad(loss_fn, has_aux=True)
      def accumulate(total, episode):
        return jax.tree.map(jnp.add, total, grad_fn(params, episode)), None
      first = jax.tree.map(lambda x: x[0], row)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(grad_fn, params, first))
      total, _ = jax.lax.scan(accumulate, zeros, row)
      grads, metrics = jax.tree.map(lambda x: x / size, total)
    # One all-reduce of one vector: of a pytree, XLA makes several, which may
    # run at once, and two collectives in flight can hang XLA:CPU (each holds
    # one of the pool's threads while it waits for the other devices).
    flat, unravel = flatten_util.ravel_pytree((grads, metrics))
    return unravel(jax.lax.pmean(flat, 'data'))

  return jax.shard_map(device_grads, mesh=mesh, in_specs=(jax.P(), jax.P('data')),
                       out_specs=jax.P(), check_vma=False)(params, episodes)
