"""parallel.hosts and mesh.Placement across two processes (jax.distributed on localhost, 2
fake CPU devices each): broadcast gives process 0's values everywhere, fetch gathers arrays
that span processes and leaves each process's own arrays as they are, and a data-parallel
jit over placed rows all-reduces over both processes."""

import json
import os
import re
import sys
import textwrap

import pytest

from diversed_jax.parallel import hosts
from diversed_jax.parallel import mesh as mesh_lib
from tests import two_processes, xla_flags

_SCRIPT = textwrap.dedent("""
    import json, sys
    from diversed_jax.parallel import hosts
    assert hosts.initialize_distributed()
    import jax, jax.numpy as jnp, numpy as np
    from diversed_jax.parallel import mesh as mesh_lib
    me = jax.process_index()
    placement = mesh_lib.Placement(mesh_lib.make_mesh())
    rows = placement.rows(np.arange(8, dtype=np.float32))  # the same host value everywhere
    scale = placement.params(np.float32(3.0))
    total = jax.jit(lambda r, s: (r * s).sum())(rows, scale)  # sums over both processes
    mine = jnp.asarray([me, me], jnp.int32)  # this process's own value
    got = hosts.fetch({"rows": rows * 2, "total": total, "mine": mine})
    sent = hosts.broadcast({"a": np.full((3,), me + 1, np.int32), "b": np.float32(me + 7)})
    print("RESULT", json.dumps({
        "rows": got["rows"].tolist(), "total": float(got["total"]),
        "mine": got["mine"].tolist(), "a": sent["a"].tolist(), "b": float(sent["b"]),
        "local_rows": len(rows.addressable_shards), "writer": hosts.is_writer()}))
""")


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags.flags(devices=2))
  outs = two_processes.run(lambda i: [sys.executable, "-c", _SCRIPT], env, timeout=240)
  return [json.loads(next(line for line in out.splitlines()
                          if line.startswith("RESULT "))[len("RESULT "):]) for out in outs]


def test_broadcast_gives_process_0s_values_everywhere(results):
  for r in results:
    assert r["a"] == [1, 1, 1] and r["b"] == 7.0


def test_fetch_gathers_what_spans_processes_and_keeps_each_process_own(results):
  for me, r in enumerate(results):
    assert r["local_rows"] == 2  # 8 rows over 4 devices: 2 shards on each process
    assert r["rows"] == [2.0 * i for i in range(8)]
    assert r["total"] == 3.0 * sum(range(8))
    assert r["mine"] == [me, me]  # not concatenated with the other process's
  assert [r["writer"] for r in results] == [True, False]


def test_one_process_is_unchanged():
  tree = {"a": [1, 2], "b": 3.0}
  assert hosts.broadcast(tree) is tree
  assert hosts.fetch({"x": 1.5}) == {"x": 1.5}
  # Process 0's bytes, or b"" for None, as several processes give them.
  assert hosts.broadcast_bytes(b"ab") == b"ab" and hosts.broadcast_bytes(None) == b""


@pytest.mark.parametrize("call, message", [
    (lambda: mesh_lib.data_mesh(0, 8), "decode.mesh_data=0: -1 (all devices) or a positive"),
    (lambda: mesh_lib.data_mesh(-2, 8, field="train.mesh_data"), "train.mesh_data=-2"),
    (lambda: mesh_lib.make_mesh(model=0), "mesh model=0 must be >= 1"),
    (lambda: mesh_lib.make_mesh(data=0), "mesh data=0"),
])
def test_mesh_sizes_below_one_are_refused(call, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    call()
