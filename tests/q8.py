"""GGUF Q8_0-style weights for the tests of int8 storage: int8 values times a float16 scale
per block of 32 (as the embedded model's embedding is stored)."""

import numpy as np


def q8_0_weights(rng, rows: int, cols: int, scale_range=(0.001, 0.05)):
  """(q int8 [rows, cols], scale float32 [rows, cols // 32], w = q * scale float32). Each
  block starts with 127, so its largest magnitude sets its scale, as in Q8_0."""
  q = rng.integers(-127, 128, (rows, cols)).astype(np.int8)
  q[:, ::32] = 127
  scale = rng.uniform(*scale_range, (rows, cols // 32)).astype(np.float16).astype(np.float32)
  w = (q.reshape(rows, -1, 32).astype(np.float32) * scale[..., None]).reshape(rows, cols)
  return q, scale, w
