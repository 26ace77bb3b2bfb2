"""Run by test_parallel.py in a fresh process with fake CPU devices (XLA_FLAGS set first).

For each argument N:VECTORIZE, takes one training step on the same global batch of
episodes over a mesh of the first N devices and over a mesh of one device, and prints the
largest differences as one JSON line. VECTORIZE is `model.vectorize` ('vmap' or 'loop':
how each device takes its episodes).
"""

import json
import sys

import jax
import numpy as np

from cht_jax import methods
from cht_jax import optim
from cht_jax import train
from configs import omniglot_t2

COLLECTIVES = ('all-reduce', 'all-gather', 'all-to-all', 'reduce-scatter', 'collective-permute')


def one_step(config, devices, images):
  mesh = jax.sharding.Mesh(np.array(devices), ('data',),
                           axis_types=(jax.sharding.AxisType.Auto,))
  replicated = jax.NamedSharding(mesh, jax.P())
  method = methods.build(config)
  optimizer = optim.make_optimizer(config.optim)
  state = train.make_init(method, optimizer, mesh)(jax.random.key(0))
  step = train.make_train_step(method, optimizer, mesh)
  images = jax.device_put(images, replicated)
  hlo = step.lower(state, images, jax.random.key(7)).compile().as_text()
  collectives = {op: hlo.count(f' {op}(') for op in COLLECTIVES}
  initial_params = jax.device_get(state.params)  # Before the step donates them.
  new_state, metrics = step(state, images, jax.random.key(7))
  return initial_params, jax.device_get(new_state.params), jax.device_get(metrics), collectives


def compare(num_devices, vectorize):
  config = omniglot_t2.get_config('tiny')
  config.model.vectorize = vectorize
  config.train.episodes_per_step = 8
  config.optim.name = 'sgd'  # Adam's first step is sign(g) * lr: it would amplify float noise.
  config.optim.learning_rate = 0.01
  images = np.random.default_rng(0).integers(0, 256, (12, 20, 16, 16, 1), dtype=np.uint8)
  _, params_n, metrics_n, collectives = one_step(config, jax.devices()[:num_devices], images)
  initial_params, params_1, metrics_1, _ = one_step(config, jax.devices()[:1], images)
  diff = lambda a, b: max(float(np.max(np.abs(x - y)))
                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  return {
      'devices': num_devices,
      'vectorize': vectorize,
      'collectives': collectives,
      'loss': [float(metrics_n['loss']), float(metrics_1['loss'])],
      'grad_norm': [float(metrics_n['grad_norm']), float(metrics_1['grad_norm'])],
      'max_param_diff': diff(params_n, params_1),
      'max_param_change': diff(params_1, initial_params),
  }


def main():
  for case in sys.argv[1:]:
    num_devices, vectorize = case.split(':')
    assert jax.device_count() >= int(num_devices), jax.devices()
    print(json.dumps(compare(int(num_devices), vectorize)), flush=True)


if __name__ == '__main__':
  main()
