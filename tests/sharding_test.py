"""The speculative loop and the head's teacher-forced pass run unchanged on a data-parallel
mesh (4 fake CPU devices)."""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from diversed_jax.models import ModelConfig, init_params
    from diversed_jax.parallel import mesh as mesh_lib
    from diversed_jax.speculative import decoder as dec, drafts
    from diversed_jax.speculative.types import VerifyParams
    assert len(jax.devices()) == 4, jax.devices()
    cfg = ModelConfig(vocab_size=13, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=48)
    dcfg = cfg.truncated(1)
    tp = init_params(cfg, jax.random.PRNGKey(0), std=0.5)
    dp = init_params(dcfg, jax.random.PRNGKey(1), std=0.5)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3], [1, 5, 2], [7, 7, 7], [2, 4], [9, 1]]
    for batch_size in (None, 4):  # 4 rows, 8 prompts: continuous batching
      outs = []
      for mesh in (None, mesh_lib.make_mesh()):
        d = dec.SpeculativeDecoder(dec.ModelHandle(cfg, tp), drafts.LMDraft(dcfg), dp,
                                   mesh=mesh)
        outs.append(d.generate(prompts, VerifyParams(method="sd", temperature=1.0),
                               num_draft=3, max_new_tokens=10, seed=5, eos_token_ids=(),
                               batch_size=batch_size))
      assert outs[0].token_ids == outs[1].token_ids, (outs[0].token_ids, outs[1].token_ids)
    # The head's teacher-forced pass: rows split over the 4 devices (a chunk of 3 rows is
    # rounded up to 4), the values those of one device.
    import numpy as np
    from diversed_jax.training import teacher_forced as tf_lib
    gens = [[5, 6], [7], [1, 2, 3, 4], [8, 8], [2], [3, 4, 5], [6, 6, 6], [9]]
    batches = []
    for placement in (mesh_lib.Placement(), mesh_lib.Placement(mesh_lib.make_mesh())):
      batches.append(tf_lib.teacher_forced_batch(
          cfg, placement.params(tp), drafts.LMDraft(dcfg), placement.params(dp), prompts,
          gens, temperature=1.0, num_new=4, chunk_rows=3, placement=placement))
    for k, v in batches[0].items():
      assert len(batches[1][k].sharding.device_set) == 4, (k, batches[1][k].sharding)
      np.testing.assert_allclose(np.asarray(batches[1][k]), np.asarray(v), rtol=1e-4,
                                 atol=1e-5)
    print("OK", mesh_lib.make_mesh().shape)
""")


def test_data_parallel_mesh_gives_identical_tokens():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "OK" in result.stdout
