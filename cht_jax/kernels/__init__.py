"""Backend kernels for named operations of the model; `registry` is where they meet.

The model (cht_jax/models) holds the definitions and imports only `registry`;
each backend package (`cpu`) is imported on first use and registers its kernels.
"""
