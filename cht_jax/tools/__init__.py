"""Developer tools, entry points nothing in the package imports: `bench` (training,
evaluation and generation speed), `bench_pipeline` (does the host pipeline keep up),
`bench_episodes` (the episode sampler alone) and `profiling` (for `bench --profile_steps`).
"""
