"""The runtime, none of it the paper's method: devices and processes (devices.py), Orbax
checkpoints, the workdir's lock, config record and metrics (workdir.py), SIGTERM and
Ctrl-C (preemption.py), and non-finite steps and loss spikes (divergence.py).
"""
