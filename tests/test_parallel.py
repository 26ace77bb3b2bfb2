"""Data parallelism: a step over N devices equals the same step on one device."""

import json
import os
import subprocess
import sys

import numpy as np

from conftest import REPO_ROOT


CASES = [(4, 'loop'), (8, 'vmap')]


def test_sharded_step_equals_single_device():
  """Each device loops over its episodes (the CPU default) on 4 devices, or vmaps them
  (the accelerator default) on 8: one process with 8 devices runs both."""
  flags = os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO_ROOT))
  result = subprocess.run([sys.executable, 'tests/parallel_worker.py',
                           *(f'{n}:{vectorize}' for n, vectorize in CASES)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  reports = [json.loads(line) for line in result.stdout.strip().splitlines()[-len(CASES):]]
  for (num_devices, vectorize), report in zip(CASES, reports):
    assert (report['devices'], report['vectorize']) == (num_devices, vectorize)
    # One collective per step: two in flight at once can hang XLA:CPU (train.py).
    assert report['collectives'] == {'all-reduce': 1, 'all-gather': 0, 'all-to-all': 0,
                                     'reduce-scatter': 0, 'collective-permute': 0}, report
    np.testing.assert_allclose(*report['loss'], rtol=1e-5, err_msg=vectorize)
    np.testing.assert_allclose(*report['grad_norm'], rtol=1e-4, err_msg=vectorize)
    # The step changed the parameters, identically on N devices and on one.
    assert report['max_param_change'] > 1e-5, report
    assert report['max_param_diff'] < 1e-6 + 1e-3 * report['max_param_change'], report
