"""The code sandbox: ordinary programs run, hostile ones fail and are contained.

Containment is checked from the outside: no file appears outside the sandbox, no process
started by the program survives the call (found by a marker in its command line), the call
returns within timeout + margin, and the temporary directories are gone.
"""

import os
import signal
import socket
import textwrap
import time
import uuid

import pytest

from diversed_jax.tasks import sandbox

MARGIN_S = 8.0  # teardown and a busy shared machine
ISO = sandbox.isolation()
needs_pid_containment = pytest.mark.skipif(
    not (ISO.pid_namespace or ISO.pids_cgroup),
    reason="no PID namespace or pids cgroup here: setsid() children can escape")
needs_pids_cgroup = pytest.mark.skipif(
    not ISO.pids_cgroup, reason="no writable pids cgroup: an unguarded fork bomb is unsafe")
needs_netns = pytest.mark.skipif(not ISO.network_namespace, reason="no network namespace")


def _run(source, **kwargs):
  start = time.monotonic()
  result = sandbox.run_program(textwrap.dedent(source), **kwargs)
  return result, time.monotonic() - start


def _processes_with(marker: str) -> list[int]:
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
          if marker.encode() in f.read():
            found.append(int(entry))
      except OSError:
        pass
  return found


def _our_cgroups() -> list[str]:
  parent = os.path.join(sandbox._CGROUP_ROOT, "diversed_jax_sandbox")
  if not os.path.isdir(parent):
    return []
  return [d for d in os.listdir(parent) if d.startswith(f"run_{os.getpid()}_")]


def test_ordinary_programs():
  ok, _ = _run("print('hello'); import math; assert math.sqrt(4) == 2")
  assert ok.passed and ok.returncode == 0 and ok.stdout_tail == "hello\n"
  failed, _ = _run("assert 1 == 2, 'boom'")
  assert not failed.passed and failed.returncode == 1 and "AssertionError: boom" in (
      failed.stderr_tail)
  syntax, _ = _run("def f(:\n  pass")
  assert not syntax.passed and "SyntaxError" in syntax.stderr_tail
  # Exiting with status 0 before the asserts run must not count as passing.
  for early_exit in ("import sys; sys.exit(0)\nassert False", "import os; os._exit(0)",
                     "quit()", "exit(0)"):
    result, _ = _run(early_exit)
    assert result.returncode == 0 and not result.passed, early_exit
  # Writing inside the working directory, temp files and stdin at EOF are fine.
  inside, _ = _run("""
      import os, tempfile, pathlib
      pathlib.Path('sub').mkdir()
      with open('sub/a.txt', 'w') as f:
        f.write('x')
      os.rename('sub/a.txt', 'sub/b.txt')
      assert open('sub/b.txt').read() == 'x'
      with tempfile.NamedTemporaryFile('w') as t:
        t.write('y')
      try:
        input()
      except EOFError:
        print('eof')
      """)
  assert inside.passed, inside.stderr_tail
  assert inside.stdout_tail == "eof\n"


def test_infinite_loop_times_out():
  result, elapsed = _run("while True:\n  pass", timeout_s=1.0)
  assert result.timed_out and not result.passed
  assert result.returncode == -signal.SIGKILL
  assert elapsed < 1.0 + MARGIN_S
  asleep, elapsed = _run("import time; time.sleep(60)", timeout_s=1.0)
  assert asleep.timed_out and not asleep.passed and elapsed < 1.0 + MARGIN_S


def test_cpu_limit_stops_a_spinning_program_before_the_wall_clock():
  result, elapsed = _run("while True:\n  pass", timeout_s=30.0, cpu_s=1)
  assert not result.passed and not result.timed_out
  # SIGXCPU kills the program; `unshare`, when used, reports that as a plain failure.
  assert result.returncode != 0
  assert elapsed < 20.0


@pytest.mark.parametrize("source", [
    "x = bytearray(4 * 1024 ** 3)",
    "chunks = []\nwhile True:\n  chunks.append(bytearray(10 ** 7))",
])
def test_memory_hog_fails_with_memory_error(source):
  result, elapsed = _run(source, timeout_s=20.0, memory_mb=256)
  assert not result.passed and not result.timed_out
  assert "MemoryError" in result.stderr_tail
  assert elapsed < 20.0


def test_output_flood_is_bounded():
  result, elapsed = _run("import sys\nwhile True:\n  sys.stdout.write('x' * 65536)",
                         timeout_s=20.0, file_size_mb=1)
  assert not result.passed and elapsed < 20.0
  assert len(result.stdout_tail) <= 4096
  assert "File too large" in result.stderr_tail


@pytest.mark.parametrize("source", [
    "import os\nwhile True:\n  os.fork()",
    "import posix\nposix.fork()",
    "import multiprocessing\nmultiprocessing.Process(target=print).start()",
    "import subprocess\nsubprocess.run(['true'])",
    "import os\nos.system('true')",
    "import os\nos.execv('/bin/true', ['true'])",
    "import os\nos.posix_spawn('/bin/true', ['true'], {})",
    "import pty\npty.fork()",
    "import ctypes\nctypes.CDLL(None).fork()",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "import os, signal\nos.killpg(0, signal.SIGKILL)",
    "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
])
def test_guard_blocks_processes_and_signals(source):
  result, elapsed = _run(source, timeout_s=10.0)
  assert not result.passed and not result.timed_out, result
  assert "sandbox:" in result.stderr_tail or "import of ctypes halted" in result.stderr_tail
  assert elapsed < 10.0


@needs_pids_cgroup
def test_unguarded_fork_bomb_is_capped_and_killed(tmp_path):
  # The guard is off, as if the program had got around it: the pids cgroup caps it while it
  # runs, and nothing it forked survives the call.
  bomb = """
      import os
      while True:
        try:
          os.fork()
        except OSError:
          pass
      """
  result, elapsed = _run(bomb, timeout_s=2.0, guard=False, max_processes=32,
                         tmp_root=str(tmp_path))
  assert result.timed_out and not result.passed
  assert elapsed < 2.0 + MARGIN_S
  assert _processes_with(str(tmp_path)) == []
  assert os.listdir(tmp_path) == []
  assert _our_cgroups() == []


def _spawn_sleepers(marker: str, setsid: bool, parent_waits: bool) -> str:
  return f"""
      import os, time
      for _ in range(4):
        if os.fork() == 0:
          {'os.setsid()' if setsid else 'pass'}
          os.execv('/bin/sleep', ['sleep', '{marker}'])
      {'time.sleep(60)' if parent_waits else 'print("parent done")'}
      """


@pytest.mark.parametrize("parent_waits", [False, True])
def test_children_in_the_process_group_are_killed(parent_waits):
  marker = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10 ** 6:06d}"
  result, elapsed = _run(_spawn_sleepers(marker, setsid=False, parent_waits=parent_waits),
                         timeout_s=2.0, guard=False)
  assert result.timed_out == parent_waits
  assert elapsed < 2.0 + MARGIN_S
  assert _processes_with(marker) == []


@needs_pid_containment
def test_children_that_leave_the_session_are_killed():
  marker = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10 ** 6:06d}"
  result, _ = _run(_spawn_sleepers(marker, setsid=True, parent_waits=False), timeout_s=5.0,
                   guard=False)
  assert result.stdout_tail == "parent done\n"
  assert _processes_with(marker) == []


def _write_attempts(outside, victim, victim_dir):
  return [
      f"open({str(outside)!r}, 'w').write('x')",
      f"open({str(outside)!r}, 'a')",
      f"import pathlib\npathlib.Path({str(outside)!r}).write_text('x')",
      f"import os\nos.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT)",
      f"import os\nos.symlink({str(outside)!r}, 'link')\nopen('link', 'w').write('x')",
      "import os\nos.chdir('..')\nopen('escaped.txt', 'w').write('x')",
      f"import shutil\nshutil.copy(__file__, {str(outside)!r})",
      f"import os\nos.remove({str(victim)!r})",
      f"import os\nos.rename({str(victim)!r}, {str(outside)!r})",
      f"import os\nos.chmod({str(victim)!r}, 0)",
      f"import os\nos.truncate({str(victim)!r}, 0)",
      f"import shutil\nshutil.rmtree({str(victim_dir)!r})",
      f"import os\nos.mkdir({str(outside)!r})",
  ]


def test_writing_outside_the_working_directory_is_refused(tmp_path):
  outside = tmp_path / "outside.txt"
  victim = tmp_path / "victim.txt"
  victim.write_text("keep")
  victim_dir = tmp_path / "victim_dir"
  victim_dir.mkdir()
  (victim_dir / "f").write_text("keep")
  roots = tmp_path / "sandboxes"
  roots.mkdir()
  sources = _write_attempts(outside, victim, victim_dir)
  results = sandbox.run_many(sources, workers=2, timeout_s=10.0, tmp_root=str(roots))
  for source, result in zip(sources, results):
    assert not result.passed, source
    assert "sandbox: writing" in result.stderr_tail, (source, result.stderr_tail)
  assert not outside.exists()
  assert victim.read_text() == "keep" and os.stat(victim).st_mode & 0o777 != 0
  assert (victim_dir / "f").read_text() == "keep"
  assert os.listdir(roots) == []  # every sandbox directory was removed


@pytest.mark.parametrize("guard", [True, pytest.param(False, marks=needs_netns)])
def test_socket_cannot_reach_the_host(guard):
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    source = f"""
        import socket
        s = socket.create_connection(('127.0.0.1', {port}), timeout=2)
        s.sendall(b'leak')
        """
    result, _ = _run(source, timeout_s=10.0, guard=guard)
    assert not result.passed
    with pytest.raises(socket.timeout):
      server.accept()


def test_caller_is_unharmed():
  cwd = os.getcwd()
  sources = ["import os\nos.chdir('/')\nos.kill(os.getppid(), 9)",
             "import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)",
             "import sys\nsys.stdout.close()\nsys.stderr.close()"]
  # Unguarded, os.getppid() is only harmless inside a PID namespace (where it is 0).
  for guard in (True, False) if ISO.pid_namespace else (True,):
    for source in sources:
      sandbox.run_program(source, timeout_s=5.0, guard=guard)
  assert os.getcwd() == cwd and _our_cgroups() == []


def test_run_many_keeps_order_and_runs_in_parallel():
  results = sandbox.run_many([f"print({i})" for i in range(6)], workers=3)
  assert [r.stdout_tail for r in results] == [f"{i}\n" for i in range(6)]
  start = time.monotonic()
  results = sandbox.run_many(["import time; time.sleep(1.5)"] * 4, workers=4)
  assert all(r.passed for r in results)
  assert time.monotonic() - start < 4 * 1.5


def test_isolation_probe_is_consistent():
  assert ISO.network_namespace == bool(ISO.unshare_argv) == ISO.pid_namespace
  if ISO.unshare_argv:
    assert "--kill-child" in ISO.unshare_argv
