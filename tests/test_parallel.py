"""Data parallelism: a step over N devices equals the same step on one device."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT


# Each device loops over its episodes (the CPU default) or vmaps them (the accelerator default).
@pytest.mark.parametrize('num_devices,vectorize', [(4, 'loop'), (8, 'vmap')])
def test_sharded_step_equals_single_device(num_devices, vectorize):
  flags = os.environ.get('XLA_FLAGS', '') + f' --xla_force_host_platform_device_count={num_devices}'
  env = dict(os.environ, XLA_FLAGS=flags,
             JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO_ROOT))
  result = subprocess.run([sys.executable, 'tests/parallel_worker.py', str(num_devices), vectorize],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report['devices'] == num_devices
  # One collective per step: two in flight at once can hang XLA:CPU (train.py).
  assert report['collectives'] == {'all-reduce': 1, 'all-gather': 0, 'all-to-all': 0,
                                   'reduce-scatter': 0, 'collective-permute': 0}
  np.testing.assert_allclose(*report['loss'], rtol=1e-5)
  np.testing.assert_allclose(*report['grad_norm'], rtol=1e-4)
  # The step changed the parameters, identically on N devices and on one.
  assert report['max_param_change'] > 1e-5
  assert report['max_param_diff'] < 1e-6 + 1e-3 * report['max_param_change']
