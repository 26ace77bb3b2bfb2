"""The runtime: what keeps a long run going on shared machines, none of it the paper's method:
the devices a batch is split over and several processes (devices.py), Orbax checkpoints
(checkpoints.py), the workdir with its lock, config record and metrics (workdir.py), SIGTERM
and Ctrl-C (preemption.py), and the rule for non-finite steps and loss spikes (divergence.py).
"""
