"""The launcher's plan: which runs share a torchrun launch (launcher.launches),
and the plan file that tells each rank every run's leg (modes.load_plan).
Pure functions, and a launch held behind another: the launches themselves run in every gate test."""

from __future__ import annotations

import json

import pytest

from dormouse.errors import DormouseError
from dormouse.gate.record import modes
from dormouse.gate.record.launcher import launches
from dormouse.gate.settings import GateSettings


def _gs(tmp_path, name, **kw):
    return GateSettings(out=str(tmp_path / name), **kw).validate()


def test_first_legs_and_one_launch_runs_share_a_launch_per_world_then_the_second_legs(tmp_path):
    a = _gs(tmp_path, "a")  # the default: world 2, resumed at 1 rank
    b = _gs(tmp_path, "b", resume_world=0)  # one launch at world 2
    c = _gs(tmp_path, "c", resume_world=3)  # world 2, resumed at 3 ranks
    d = _gs(tmp_path, "d", world=3, profile="2,1,1", micro_batch=1)  # world 3, resumed at 1 rank
    e = _gs(tmp_path, "e", shard="fsdp")  # world 2, resumed at 1 rank
    got = [(legs, [s.out_dir.name for s in runs], {s.legs()[leg - 1].world if leg else s.world
                                                    for leg, s in zip(legs, runs)})
           for legs, runs in launches([a, b, c, d, e])]
    assert got == [
        ([1, 0, 1, 1], ["a", "b", "c", "e"], {2}),  # every first leg and one-launch run at world 2
        ([1], ["d"], {3}),
        ([2, 2, 2], ["a", "d", "e"], {1}),  # the second legs at one rank, after every first leg
        ([2], ["c"], {3}),
    ]


def test_a_plan_file_gives_each_run_its_leg_and_a_broken_one_is_one_line(tmp_path):
    a, b = _gs(tmp_path, "a"), _gs(tmp_path, "b", resume_world=0)
    import dataclasses

    f = tmp_path / "plan.json"
    f.write_text(json.dumps([{"leg": 1, "settings": dataclasses.asdict(a)},
                             {"leg": 0, "settings": dataclasses.asdict(b)}]))
    plan, legs = modes.load_plan(str(f), validated=True)
    assert [s.out_dir for s in plan] == [a.out_dir, b.out_dir] and legs == [1, 0]
    f.write_text(json.dumps([{"leg": 1, "settings": dataclasses.asdict(a)}, dataclasses.asdict(b)]))
    with pytest.raises(DormouseError, match="is not a JSON list of legs and gate settings"):
        modes.load_plan(str(f))
    with pytest.raises(DormouseError, match="a plan of 1 runs with 2 legs"):
        modes.run_rank_plan([a], leg=[1, 2])


def test_a_gate_fleet_has_an_interpreter_per_rank_unless_forked_ranks_are_asked_for_on_cpu(tmp_path):
    """The command of a launch: torchrun's own CLI. By default one interpreter
    per rank (`-m dormouse.gate rank`); with fork_ranks, or a launch of one
    rank, the ranks forked from its agent (--run-path, dormouse.gate's entry
    point as the script), on CPU only (a process forked from one that touched
    CUDA cannot use it)."""
    import dataclasses
    import sys

    import dormouse.__main__
    import dormouse.gate.__main__
    from dormouse.gate.record.launcher import FORKED_RANKS, torchrun, torchrun_command

    s = _gs(tmp_path, "a", resume_world=0)
    fresh = torchrun_command(s)
    assert fresh[:3] == [sys.executable, "-m", "torch.distributed.run"] and not set(FORKED_RANKS) & set(fresh)
    assert fresh[fresh.index("--nproc_per_node=2") + 1:][:3] == ["-m", "dormouse.gate", "rank"]
    forked = torchrun_command(s, fork_ranks=True)
    i = forked.index(FORKED_RANKS[0])
    assert forked[i:i + 4] == [*FORKED_RANKS, dormouse.gate.__main__.__file__] and forked[i + 4] == "rank"
    assert torchrun_command(dataclasses.replace(s, device="cuda"), fork_ranks=True) == \
        torchrun_command(dataclasses.replace(s, device="cuda"))
    # A launch of one rank (the default stop-and-resume's second leg) is forked: no peer to hash alike with.
    d = _gs(tmp_path, "d")  # world 2, resumed at 1 rank
    assert not set(FORKED_RANKS) & set(torchrun_command(d, leg=1))
    second = torchrun_command(d, leg=2)
    assert "--nproc_per_node=1" in second and second[second.index(FORKED_RANKS[0]):][:3] == FORKED_RANKS
    assert not set(FORKED_RANKS) & set(torchrun_command(dataclasses.replace(d, device="cuda"), leg=2))
    # -m MODULE becomes the module's file (a package: its __main__), as `python -m` would run it
    assert torchrun(["-m", "dormouse", "train"])[-2:] == [dormouse.__main__.__file__, "train"]
    with pytest.raises(DormouseError, match="no module named 'no_such_module'"):
        torchrun(["-m", "no_such_module"])


@pytest.mark.slow  # outside CI's time (`pytest -m slow`): a past review's finding; CI's fleets all run fresh interpreters
def test_a_fault_only_separate_interpreters_show_fails_the_default_gate_and_passes_forked_ranks(tmp_path):
    """hash_order (fleet_faults): each rank lays its gradients out for the
    reduce in an order set by Python's string hash, per interpreter. With an
    interpreter per rank (the gate's default) the ranks disagree and the gate
    fails; ranks forked from one agent share its hash secret and agree, and the
    gate passes: why verdicts come from fresh interpreters (a review found it)."""
    import os

    from gatekit import faulty_fleets, judged

    assert "PYTHONHASHSEED" not in os.environ, "a fixed PYTHONHASHSEED makes every interpreter hash alike"
    fresh, forked = (_gs(tmp_path, name, steps=4, resume_world=0) for name in ("fresh", "forked"))
    faulty_fleets([(fresh, "hash_order")], fork_ranks=False, cold=True)  # not the suite's warm interpreters
    faulty_fleets([(forked, "hash_order")], fork_ranks=True)
    v = judged(fresh)
    assert not v.passed and not v.check("gradient").passed and not v.check("ranks").passed
    assert judged(forked).passed  # the limit of forked ranks


def test_a_second_launch_starts_during_the_first_held_and_dies_with_it_when_the_first_fails(tmp_path):
    """launch_plan starts a fleet's second launch while its first runs, its ranks held (hold_for_go):
    here the first leg's ranks wait until a second-leg rank has started, then fail. The plan fails
    naming the first leg, the held rank never passed its hold, and no process of either launch is left."""
    import os
    import time

    from dormouse.errors import FleetError
    from dormouse.gate.record.launcher import HOLD_ENV, launch_plan

    s = _gs(tmp_path, "a", steps=2)  # world 2, resumed at 1 rank: two launches
    started, released = tmp_path / "leg2_started", tmp_path / "leg2_released"
    script = tmp_path / "legs.py"
    script.write_text(f"""
import os, sys, time
from pathlib import Path
if "--leg=2" in sys.argv:
    Path({str(started)!r}).write_text(f"{{os.getpid()}} {{os.environ.get({HOLD_ENV!r}, '')}}")
    from dormouse.gate.record.launcher import hold_for_go
    hold_for_go()
    Path({str(released)!r}).write_text("")
    sys.exit(0)
deadline = time.monotonic() + 120
while not Path({str(started)!r}).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
print("error: leg 1 fails on purpose", flush=True)
sys.exit(3)
""")
    with pytest.raises(FleetError, match="leg 1 fails on purpose"):
        launch_plan([s], entry=[str(script)], fork_ranks=True, timeout_s=120)
    assert started.exists(), "the second launch was not started during the first, held"
    pid, go = started.read_text().split(" ", 1)
    assert go, "the second launch's ranks were not told to hold"
    time.sleep(0.5)
    assert not released.exists() and not os.path.exists(go)
    try:
        os.kill(int(pid), 0)
        alive = open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    assert not alive, "the held rank outlived the plan"


def test_a_held_rank_waits_for_its_go_file_and_ends_in_one_line_when_none_comes(tmp_path, monkeypatch):
    import os

    from dormouse.errors import FleetError
    from dormouse.gate.record.launcher import HOLD_ENV, HOLD_S_ENV, hold_for_go

    go = tmp_path / "go"
    monkeypatch.setenv(HOLD_ENV, str(go))
    monkeypatch.setenv(HOLD_S_ENV, "0.3")
    with pytest.raises(FleetError, match="no word came in 0.3 s"):
        hold_for_go()
    go.write_text("")
    hold_for_go()  # released at once, and no longer held: nothing the rank starts inherits the hold
    assert HOLD_ENV not in os.environ and HOLD_S_ENV not in os.environ
    go.unlink()
    hold_for_go()  # not a held launch
