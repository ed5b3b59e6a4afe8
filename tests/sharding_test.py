"""The speculative loop (also with a queue, one per device), SMC decoding and the loop's
policy record for head training run unchanged on a data-parallel mesh (4 fake CPU
devices)."""

import os
import subprocess
import sys
import textwrap

from tests import xla_flags

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
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
    for batch_size in (None,):  # one batch split over the devices: the same samples
      outs = []
      for mesh in (None, mesh_lib.make_mesh()):
        d = dec.SpeculativeDecoder(dec.ModelHandle(cfg, tp), drafts.LMDraft(dcfg), dp,
                                   mesh=mesh)
        outs.append(d.generate(prompts, VerifyParams(method="sd", temperature=1.0),
                               num_draft=3, max_new_tokens=10, seed=5, eos_token_ids=(),
                               batch_size=batch_size))
      assert outs[0].token_ids == outs[1].token_ids, (outs[0].token_ids, outs[1].token_ids)
    # A queue: each device runs its own over a block of the prompts (split_queue). Greedy
    # calls give the one-device tokens and rounds, with or without a shrinking tail.
    many = prompts + [p[::-1] for p in prompts]  # 16 prompts through 8 rows, 2 per device
    for shrink_tail in (False, True):
      outs = []
      for mesh in (None, mesh_lib.make_mesh()):
        d = dec.SpeculativeDecoder(dec.ModelHandle(cfg, tp), drafts.LMDraft(dcfg), dp,
                                   mesh=mesh, shrink_tail=shrink_tail)
        outs.append(d.generate(many, VerifyParams(method="sd", temperature=0.0),
                               num_draft=3, max_new_tokens=10, seed=5, eos_token_ids=(4,),
                               batch_size=8))
      assert outs[0].token_ids == outs[1].token_ids, (outs[0].token_ids, outs[1].token_ids)
      assert outs[0].accepted_per_round == outs[1].accepted_per_round
      # width_r: the rows each round ran over all devices (finished devices run none).
      stats = outs[1].stats
      assert sum(len(a) for a in outs[1].accepted_per_round) == int(stats.active_rb.sum())
      assert stats.width_r[0] == 8 and np.all(stats.active_rb.sum(1) <= stats.width_r)
    # Sampled: each device draws from its own stream (blocks of one repeated prompt
    # differ), and every prompt's rounds commit its tokens.
    d = dec.SpeculativeDecoder(dec.ModelHandle(cfg, tp), drafts.LMDraft(dcfg), dp,
                               mesh=mesh_lib.make_mesh())
    same = d.generate([[1, 2, 3]] * 8, VerifyParams(method="sd", temperature=1.0),
                      num_draft=3, max_new_tokens=12, seed=5, eos_token_ids=(),
                      batch_size=4)
    blocks = [same.token_ids[i:i + 2] for i in range(0, 8, 2)]
    assert len({str(b) for b in blocks}) == 4, blocks
    for tokens, accepted in zip(same.token_ids, same.accepted_per_round):
      assert len(tokens) == 12 and sum(n + 1 for n in accepted) >= 12
    try:
      d.generate([[1, 2, 3]] * 6, VerifyParams(method="sd"), batch_size=4)
      raise AssertionError("6 prompts over 4 devices were not refused")
    except ValueError as e:
      assert "6 prompts through batch_size=4 rows: a queue is split over the 4" in str(e), e
    # SMC: each call's prompts split over the devices with their particles, resampled
    # every round: the one-device samples.
    outs = []
    for mesh in (None, mesh_lib.make_mesh()):
      d = dec.SpeculativeDecoder(dec.ModelHandle(cfg, tp), drafts.LMDraft(dcfg), dp,
                                 mesh=mesh)
      outs.append(d.generate(prompts, VerifyParams(method="smc", particles=3,
                                                   ess_threshold=1.0),
                             num_draft=2, max_new_tokens=9, seed=5, eos_token_ids=(),
                             batch_size=4))
    assert outs[0].token_ids == outs[1].token_ids, (outs[0].token_ids, outs[1].token_ids)
    try:
      d.generate(prompts[:6], VerifyParams(method="smc"), batch_size=3)
      raise AssertionError("3 prompts a call over 4 devices were not refused")
    except ValueError as e:
      assert "splits the 3 prompts of a call over 4 devices" in str(e), e
    # SSD takes a device for the target and one for the draft: the main job refuses it
    # over a mesh before loading anything.
    import os, diversed_jax
    from diversed_jax.evaluation import config_io, context
    root = os.path.dirname(os.path.dirname(diversed_jax.__file__))
    job = config_io.load_config(root + "/configs/gsm8k.py", {"decode.batch_size": 4})
    assert context.decode_mesh(job, families={"sd"}) is not None
    try:
      context.decode_mesh(job, families={"sd", "ssd"})
      raise AssertionError("ssd over a mesh was not refused")
    except ValueError as e:
      assert "decode.mesh_data=-1: method 'ssd' places the target" in str(e), e
    # The policy record that head training reads: one sampled batch split over the
    # devices, and greedy queues (one per device), record what one device records. (Greedy
    # ensembles with w < 1 still accept at random, so the queues' head gives w = 1.)
    sampled_head = lambda params, h_q, h_p: jax.nn.sigmoid(h_q[..., 0] - h_p[..., 1])
    greedy_head = lambda params, h_q, h_p: jnp.ones_like(h_q[..., 0])
    for batch_size, temperature, head in ((None, 1.0, sampled_head), (8, 0.0, greedy_head)):
      outs = []
      for mesh in (None, mesh_lib.make_mesh()):
        d = dec.SpeculativeDecoder(dec.ModelHandle(cfg, tp), drafts.LMDraft(dcfg), dp,
                                   weight_fn=head, head_params={}, mesh=mesh)
        outs.append(d.generate(many, VerifyParams(method="diversed", temperature=temperature),
                               num_draft=3, max_new_tokens=10, seed=5, eos_token_ids=(4,),
                               batch_size=batch_size, record_policy=True))
      assert outs[0].token_ids == outs[1].token_ids, (outs[0].token_ids, outs[1].token_ids)
      for q, tokens in enumerate(outs[0].token_ids):
        for one, split in zip(jax.tree.leaves(outs[0].policy), jax.tree.leaves(outs[1].policy)):
          np.testing.assert_allclose(split[q, :len(tokens)], one[q, :len(tokens)], rtol=1e-4,
                                     atol=1e-5)
    print("OK", mesh_lib.make_mesh().shape)
""")


def test_data_parallel_mesh_gives_identical_tokens():
  env = dict(os.environ, XLA_FLAGS=xla_flags.flags(devices=4),
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "OK" in result.stdout


_DISTILL_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from diversed_jax.distill import data, train
    from diversed_jax.models import ModelConfig, init_params
    from diversed_jax.models.loading import LoadedModel
    from diversed_jax.speculative import decoder as dec
    from tests.distill_test import _tiny_config
    assert len(jax.devices()) == 4, jax.devices()
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                      eos_token_ids=())
    target = LoadedModel(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.5), "tiny", "")
    root = sys.argv[1]
    d = dec.SpeculativeDecoder(dec.ModelHandle(cfg, target.params))
    rng = np.random.default_rng(0)
    for index in range(3):
      prompts = [rng.integers(3, 64, size=int(rng.integers(4, 12))).tolist() for _ in range(6)]
      data.save_shard(root + "/shards", index, data.shard_from_prompts(
          d, prompts, temperature=1.0, max_new_tokens=20, top_k=8, seed=index,
          eos_token_ids=()))
    split = []  # devices holding each step's windows
    step_fn = train._train_step
    def spy(params, opt_state, frozen, batch, **kwargs):
      tokens = batch["tokens_bw"]
      split.append(len(tokens.sharding.device_set) if hasattr(tokens, "sharding") else 1)
      return step_fn(params, opt_state, frozen, batch, **kwargs)
    train._train_step = spy
    losses = {}
    for mesh_data in (1, -1):
      c = _tiny_config()
      c.data.dir, c.workdir = root + "/shards", f"{root}/run{mesh_data}"
      c.draft.kind, c.train.steps, c.train.mesh_data = "feature", 10, mesh_data
      c.train.eval_every, c.train.unroll = 0, 2
      first = train.Trainer(c, target, log=print).train(num_steps=5)  # checkpoint at 5
      resumed = train.Trainer(c, target, log=print)
      assert resumed.step == 5 and resumed.placement.size == (4 if mesh_data == -1 else 1)
      losses[mesh_data] = first + resumed.train()
      if mesh_data == -1:  # the restored state stays replicated over the mesh
        leaf = jax.tree.leaves(resumed.state["params"])[0]
        assert len(leaf.sharding.device_set) == 4, leaf.sharding
    assert split == [1] * 10 + [4] * 10, split
    np.testing.assert_allclose(losses[-1], losses[1], rtol=1e-4, atol=1e-6)
    print("OK", len(losses[1]))
""")


def test_distillation_splits_its_windows_and_matches_one_device(tmp_path):
  env = dict(os.environ, XLA_FLAGS=xla_flags.flags(devices=4),
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _DISTILL_SCRIPT, str(tmp_path)], env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "mesh: 4 windows a step split over data=4 devices" in result.stdout
  assert "OK 10" in result.stdout
