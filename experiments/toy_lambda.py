"""The toy trade-off: 12 training steps on the tiny random pair at several lambda.

  python experiments/toy_lambda.py
prints, per lambda, mean reward / w / acceptance over the first and last 3 steps.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diversed_jax.training import toy  # noqa: E402


def main():
  print("| lambda | reward (steps 1-3 -> 10-12) | mean w | acceptance proxy | "
        "acceptance rate | tokens / round |")
  print("|---|---|---|---|---|---|")
  for lam in (0.0, 0.5, 2.0):
    with tempfile.TemporaryDirectory() as workdir:
      toy.run(workdir, progress=None, lam=lam)
      m = {}
      for line in open(os.path.join(workdir, "metrics.jsonl")):
        r = json.loads(line)
        m[r["step"]] = r
    avg = lambda k, steps: sum(m[s][k] for s in steps) / len(steps)
    a, b = (1, 2, 3), (10, 11, 12)
    cell = lambda k: f"{avg(k, a):.3f} -> {avg(k, b):.3f}"
    print(f"| {lam} | {cell('reward')} | {cell('w_mean')} | {cell('acceptance_proxy')} | "
          f"{cell('acceptance_rate')} | {cell('tokens_per_round')} |", flush=True)


if __name__ == "__main__":
  main()
