"""Data parallelism: a step over N devices equals the same step on one device, and
looping over a device's episodes equals vmapping them."""

import json
import os
import subprocess
import sys

import numpy as np

from conftest import REPO_ROOT


def test_sharded_step_equals_single_device_and_loop_equals_vmap():
  """Each device loops over its episodes (the CPU default) on 4 devices, or vmaps them
  (the accelerator default) on 8: one fresh process with 8 fake devices runs both."""
  flags = os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO_ROOT))
  result = subprocess.run([sys.executable, 'tests/parallel_worker.py', '4:loop', '8:vmap'],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  for vectorize, num_devices in (('loop', 4), ('vmap', 8)):
    case = report[vectorize]
    assert case['devices'] == num_devices, case
    # One collective per step: two in flight at once can hang XLA:CPU (train.py).
    assert case['collectives'] == {'all-reduce': 1, 'all-gather': 0, 'all-to-all': 0,
                                   'reduce-scatter': 0, 'collective-permute': 0}, case
    np.testing.assert_allclose(*case['loss'], rtol=1e-5, err_msg=vectorize)
    np.testing.assert_allclose(*case['grad_norm'], rtol=1e-4, err_msg=vectorize)
    # The step changed the parameters, identically on N devices and on one.
    assert case['max_param_change'] > 1e-5, case
    assert case['max_param_diff'] < 1e-6 + 1e-3 * case['max_param_change'], case
  # `devices.batch_grads` looped = vmapped: the gradient of the mean loss either way.
  same = report['loop_vs_vmap']
  for name in ('loss', 'accuracy'):
    np.testing.assert_allclose(*same[name], rtol=1e-5, err_msg=name)
  assert same['update_norm'] > 0, same
  assert same['update_diff_norm'] < 1e-4 * same['update_norm'], same  # float32 sums reordered.
  validation = report['validation_on_one_device']
  assert {'loss', 'specificity_own', 'specificity_difference'} <= set(validation), validation
  assert 0 <= validation['specificity_own'] <= 1, validation
