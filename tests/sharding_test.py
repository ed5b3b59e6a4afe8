"""The speculative loop runs unchanged on a data-parallel mesh (4 fake CPU devices)."""

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
    print("OK", mesh_lib.make_mesh().shape)
""")


def test_data_parallel_mesh_gives_identical_tokens():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "OK" in result.stdout
