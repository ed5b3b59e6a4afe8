"""Two processes joined by jax.distributed on localhost, for the multi-host tests."""

import socket
import subprocess


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run(command, env, cwd=None, timeout=300) -> list[str]:
  """Runs `command(i)` (an argv) as process i of 2, with `env` plus the coordinator's
  variables; waits for both, asserts they succeeded and returns their stdout."""
  port = free_port()
  env = {k: v for k, v in env.items() if k != "JAX_COORDINATOR_ADDRESS"}
  env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2")
  procs = [subprocess.Popen(command(i), env=dict(env, JAX_PROCESS_ID=str(i)), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  try:
    outs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [out for out, _ in outs]
