"""The suite's warm interpreters (tests/support/warm.py): a child started
through the zygote behaves, to everything a test looks at, as a fresh
interpreter would, but for the hash secret they share; and a command can
ask for the real interpreter."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import warm

pytestmark = pytest.mark.skipif("client" not in warm._INSTALLED, reason="warm interpreters are off (DORMOUSE_TEST_WARM=0)")


def run(args, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, **kw)


def test_a_warm_child_has_the_callers_argv_cwd_env_streams_and_exit_status(tmp_path):
    code = "import os, sys; print(sys.argv[1:], os.getcwd(), os.environ['W_PROBE']); print('e', file=sys.stderr); sys.exit(3)"
    r = run(["-c", code, "a", "b"], cwd=tmp_path, env={**os.environ, "W_PROBE": "x1"})
    assert (r.returncode, r.stdout, r.stderr) == (3, f"['a', 'b'] {tmp_path} x1\n", "e\n")
    r = run(["-c", "raise ValueError('boom')"])
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == "ValueError: boom"
    assert "warm.py" not in r.stderr  # the traceback is the program's own
    r = run(["-m", "dormouse", "--version"])
    assert r.returncode == 0 and r.stdout.startswith("dormouse ")


def test_a_signal_to_the_clients_group_ends_the_child_and_a_killed_client_takes_it_along(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline() == "up\n"
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    pidfile = tmp_path / "pid"
    p = subprocess.Popen([sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                          "time.sleep(60)"])
    while not pidfile.exists() or not pidfile.read_text():
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert child != p.pid  # the program runs in the zygote's fork, not in the client
    p.kill()
    p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}")


def test_exit_statuses_and_the_path_are_a_fresh_interpreters(tmp_path):
    # (a review's findings: a SIGKILLed child was reported as status 1 with the client's traceback,
    # sys.exit(-1) as SIGHUP, and the zygote's '' put the working directory on a script's path)
    kill = run(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert (kill.returncode, kill.stderr) == (-signal.SIGKILL, "")
    assert run(["-c", "import sys; sys.exit(-1)"]).returncode == 255
    (tmp_path / "sub").mkdir()
    (tmp_path / "here.py").write_text("")
    (tmp_path / "sub" / "s.py").write_text("import sys\ntry:\n    import here\nexcept ImportError:\n    print('no')\n"
                                           "print(__file__, sys.path[0])\n")
    r = run(["sub/s.py"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": "rel"})
    assert r.stdout.split() == ["no", str(tmp_path / "sub" / "s.py"), str(tmp_path / "sub")], r.stderr
    missing = run(["no_such_script.py"], cwd=tmp_path)
    assert missing.returncode == 2 and "can't open file" in missing.stderr  # the interpreter's own words


def test_what_the_zygote_cannot_reproduce_runs_in_the_real_interpreter():
    r = run(["-X", "importtime", "-c", "import sys; print(sys.executable)"])
    assert r.returncode == 0 and "import time:" in r.stderr and r.stdout.strip() == warm.REAL
    r = run(["-c", "import sys; print(sys.flags.hash_randomization, hash('dormouse'))"],
            env={**os.environ, "PYTHONHASHSEED": "0"})
    assert r.stdout.split()[0] == "0"  # PYTHONHASHSEED=0 took effect: a fresh interpreter ran it


def test_warm_children_share_the_hash_secret_and_a_cold_fleets_ranks_do_not(tmp_path):
    # the limit of warm children, as of forked ranks: one secret; a command whose environment
    # says DORMOUSE_TEST_WARM=0 runs in the real interpreter, and so do the ranks it starts
    hashes = {run(["-c", "print(hash('dormouse'))"]).stdout for _ in range(2)}
    assert len(hashes) == 1
    script = tmp_path / "rank.py"
    # one write a line (print writes the line and its end apart: two ranks' lines could interleave)
    script.write_text("import os, sys; sys.stdout.write(f\"R {os.environ['RANK']} {sys.executable} {hash('dormouse')}\\n\")\n")

    def ranks(env):
        r = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)], env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        return {rank: (exe, h) for rank, exe, h in re.findall(r"R (\d) (\S+) (-?\d+)", r.stdout)}

    warm_ranks, cold_ranks = ranks(None), ranks({**os.environ, "DORMOUSE_TEST_WARM": "0"})
    assert sorted(warm_ranks) == sorted(cold_ranks) == ["0", "1"]
    assert {exe for exe, _ in warm_ranks.values()} == {sys.executable} and warm_ranks["0"][1] == warm_ranks["1"][1]
    assert {exe for exe, _ in cold_ranks.values()} == {warm.REAL} and cold_ranks["0"][1] != cold_ranks["1"][1]
