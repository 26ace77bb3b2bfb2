"""Developer tools, entry points that nothing in the package imports: the speed of training,
evaluation and generation (`python -m cht_jax.tools.bench`), whether the host pipeline keeps
up with the step (`python -m cht_jax.tools.bench_pipeline`), the on-device episode sampler
alone (`python -m cht_jax.tools.bench_episodes`), and where a compiled step's device time goes
(profiling.py, used by `bench --profile_steps`).
"""
