"""dormouse.gate.artifacts.layout names a gate run's artifacts in one place: ranks and
legs, the fleet's files and the one-process references' files, and the
trace format's reader finds ranks by those names."""

from __future__ import annotations

import re

from dormouse.gate.artifacts import ArtifactSet
from dormouse.gate.artifacts.layout import (INIT, LEG1, is_fleet_file, is_one_process_file, rank_name, rank_names, rank_of,
                                  trace_file)

NAMES = ["rank0.json", "rank12.safetensors", "leg1_rank3.json", "rank1_trace.safetensors", "init.json",
         "init_trace.safetensors", "leg1_rank0_trace.safetensors", "single.json", "exact_trace.safetensors",
         "single.safetensors", "rank.json", "rankx.json", "leg2_rank0.json", "rank0.txt", "gradref.json",
         "replay.safetensors", "xrank0.json", "rank0/"]


def test_rank_names_and_their_ranks_go_both_ways():
    assert rank_names(3) == ["rank0", "rank1", "rank2"] and rank_name(4, first_leg=True) == "leg1_rank4"
    assert [rank_of(n) for n in ["rank0", "rank17", "rank", "rankx", "leg1_rank2", "rank1_trace"]] == [
        0, 17, None, None, None, None]
    assert rank_of("leg1_rank2", LEG1) == 2 and rank_of("rank2", LEG1) is None
    assert trace_file(INIT) == "init_trace.safetensors"


def test_the_fleets_and_the_one_process_files_are_the_ones_the_old_patterns_named():
    """The two patterns produce dropped files by, before layout owned them (typed here, not shared)."""
    fleet = re.compile(r"((leg1_)?rank\d+(_trace)?|init)\.(json|safetensors)")
    one = re.compile(r"(single|exact)(_trace)?\.(json|safetensors)")
    assert [n for n in NAMES if is_fleet_file(n)] == [n for n in NAMES if fleet.fullmatch(n)]
    assert [n for n in NAMES if is_one_process_file(n)] == [n for n in NAMES if one.fullmatch(n)]
    assert sum(map(is_fleet_file, NAMES)) == 6 and sum(map(is_one_process_file, NAMES)) == 3


def test_the_trace_reader_lists_ranks_in_rank_order_and_each_leg_apart(tmp_path):
    for name in ["rank10", "rank2", "rank0", "leg1_rank1", "leg1_rank0", "rankx", "rank1_trace", "single"]:
        (tmp_path / f"{name}.json").write_text("{}")
    a = ArtifactSet(tmp_path)
    assert a.ranks() == ["rank0", "rank2", "rank10"] and a.ranks(LEG1) == ["leg1_rank0", "leg1_rank1"]
