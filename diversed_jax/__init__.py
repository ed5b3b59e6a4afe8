"""diversed_jax: relaxed speculative decoding (DIVERSED and friends) in JAX."""

__version__ = "0.1.0"
