"""Run by test_parallel.py in a fresh process with fake CPU devices (XLA_FLAGS set first).

`parallel_worker.py N:loop M:vmap` takes one training step on the same global batch of
episodes over a mesh of the first N devices, each looping over its episodes, and over
a mesh of one device; then over M devices vmapping them (`model.vectorize`), and over
one. It prints one JSON line: per way, the two steps' metrics and largest differences,
and the one-device loop against the one-device vmap; and the validation of a one-device run.
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
VECTORIZE = ('loop', 'vmap')


def tiny_config(vectorize):
  config = omniglot_t2.get_config('tiny')
  config.model.vectorize = vectorize
  # Two conv blocks, not four: the comparisons do not depend on the depth, and the four
  # steps this process compiles (its whole time) compile faster.
  config.model.num_blocks = 2
  config.train.episodes_per_step = 8
  config.optim.name = 'sgd'  # Adam's first step is sign(g) * lr: it would amplify float noise.
  config.optim.learning_rate = 0.01
  return config


def data_mesh(num_devices):
  return jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ('data',),
                           axis_types=(jax.sharding.AxisType.Auto,))


def one_step(config, mesh, initial_state, images):
  """`config`'s step from `initial_state` (host arrays, put replicated on `mesh`)."""
  replicated = jax.NamedSharding(mesh, jax.P())
  method = methods.build(config)
  step = train.make_train_step(method, optim.make_optimizer(config.optim), mesh)
  # A fresh copy: the step donates its state, and a CPU buffer may alias host memory.
  state = jax.device_put(jax.tree.map(np.array, initial_state), replicated)
  images = jax.device_put(images, replicated)
  compiled = step.lower(state, images, jax.random.key(7)).compile()
  collectives = {op: compiled.as_text().count(f' {op}(') for op in COLLECTIVES}
  new_state, metrics = compiled(state, images, jax.random.key(7))
  return jax.device_get(new_state.params), jax.device_get(metrics), collectives


def main():
  devices_of = {}  # 'loop' / 'vmap' -> number of devices, from the N:loop M:vmap arguments.
  for case in sys.argv[1:]:
    num_devices, vectorize = case.split(':')
    devices_of[vectorize] = int(num_devices)
  cases = {vectorize: devices_of[vectorize] for vectorize in VECTORIZE}  # Both, in order.
  assert jax.device_count() >= max(cases.values()), jax.devices()
  images = np.random.default_rng(0).integers(0, 256, (12, 20, 16, 16, 1), dtype=np.uint8)
  meshes = {n: data_mesh(n) for n in {*cases.values(), 1}}
  # One initial state for every step, by the trainer's init on the largest mesh (the
  # state does not depend on `vectorize`).
  config = tiny_config('loop')
  init = train.make_init(methods.build(config), optim.make_optimizer(config.optim),
                         meshes[max(meshes)])
  initial = jax.tree.map(np.array, jax.device_get(init(jax.random.key(0))))
  diff = lambda a, b: max(float(np.max(np.abs(x - y)))
                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  norm = lambda a, b: float(np.sqrt(sum(np.sum((x - y)**2)
                                        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))))
  report = {}
  one_device = {}
  for vectorize, num_devices in cases.items():
    params_n, metrics_n, collectives = one_step(tiny_config(vectorize), meshes[num_devices],
                                                initial, images)
    params_1, metrics_1, _ = one_step(tiny_config(vectorize), meshes[1], initial, images)
    one_device[vectorize] = params_1, metrics_1
    report[vectorize] = {
        'devices': num_devices,
        'collectives': collectives,
        'loss': [float(metrics_n['loss']), float(metrics_1['loss'])],
        'grad_norm': [float(metrics_n['grad_norm']), float(metrics_1['grad_norm'])],
        'max_param_diff': diff(params_n, params_1),
        'max_param_change': diff(params_1, initial.params),
    }
  (loop_params, loop_metrics), (vmap_params, vmap_metrics) = (one_device[v] for v in VECTORIZE)
  report['loop_vs_vmap'] = {
      **{name: [float(loop_metrics[name]), float(vmap_metrics[name])]
         for name in ('loss', 'accuracy')},
      # SGD: the update is -lr * gradient, so these norms compare the two gradients.
      'update_diff_norm': norm(loop_params, vmap_params),
      'update_norm': norm(vmap_params, initial.params),
  }
  # Validation of a run whose step uses fewer devices than the process has (one episode a
  # step on a CPU of many cores): it evaluates on the mesh its images were put on.
  validate = train.make_validation(methods.build(config),
                                   jax.device_put(images, jax.NamedSharding(meshes[1], jax.P())))
  report['validation_on_one_device'] = {k: float(v) for k, v in validate(
      jax.device_put(initial.params, jax.NamedSharding(meshes[1], jax.P())),
      jax.random.key(1)).items()}
  print(json.dumps(report), flush=True)


if __name__ == '__main__':
  main()
