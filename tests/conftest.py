"""Shared fixtures of the unit tests: one torch thread (the CI box has two
cores and runs two pytest workers), and the small corpora the loop tests train on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# tests/support/ (the gate kit, fault plants, rank scripts) is importable from every test folder.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

import warm  # noqa: E402  (tests/support: warm interpreters for the suite's child processes)

# The fleets' ranks are forked from torchrun's agent: gloo names their device by interface, never by
# resolving the host's name (a rank forked while an agent thread held glibc's resolver lock waits on it
# for ever; launcher.FORKED_STANDALONE says the rest). Every child process inherits it.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def pytest_configure(config):
    warm.install(config)
    import catalogue  # a deselected slow row is not launched either (catalogue.launched)

    catalogue.SKIP_SLOW = "not slow" in (config.getoption("markexpr") or "").replace("  ", " ")


def pytest_unconfigure(config):
    warm.uninstall()


# The files that take longest, longest first (their test time in one run of
# the suite, seconds). pytest-xdist's --dist loadfile deals files to the two
# workers from the front of the collection order (a few each, then one per
# finished file), so the long ones start early and the end is left to short
# ones; in one timestamped run of the suite the two workers finished 5 s
# apart. Only the order changes; a file not named here runs after these, in
# collection order. The figures from test_exact.py to test_lightning.py
# are the earlier ones scaled by each file's CPU seconds measured before and
# after its last speed-up, side by side on a loaded machine (not a suite run).
LONGEST_FIRST = (
    "tests/gate/drivers/test_notebooks.py",  # 200 (the session's pipeline run, gate_run)
    "tests/test_cli.py",  # 100
    "tests/gate/catches/test_own_fleet_faults.py",  # 130 (reads gate_run after its own fleets)
    "tests/gate/catches/test_own_fleet_planted_faults.py",  # 50 (its faulty fleets, split from the file above)
    "tests/gate/catches/test_own_fleet_once_false_passes_and_alarms.py",  # 68
    "tests/train/test_exact.py",  # 57
    "tests/train/test_resume_parity.py",  # 55 (FSDP2 ranks find DTensor imported: warm.PRELOAD)
    "tests/gate/catches/test_tensor_and_pipeline_parallel.py",  # 42 (a 2-rank and a 4-rank launch)
    "tests/gate/catches/test_hf_trainer.py",  # 40 (transformers imported once per launch: looprec.agent_imports)
    "tests/gate/catches/test_batch_level_objectives.py",  # 40
    "tests/gate/catches/test_trl_peft.py",  # 29
    "tests/gate/catches/test_lightning.py",  # 27
    "tests/gate/catches/test_accelerate.py",  # 25
    "tests/gate/drivers/test_sharded_check.py",  # 25 CPU s (a 2-rank and a 4-rank launch of gate check)
    "tests/gate/catches/test_expert_parallel.py",  # 30 (one 2-rank launch of 6 recordings)
    "tests/test_distributed.py",  # 20
    "tests/gate/catches/test_named_causes.py",  # 20
    "tests/gate/catches/test_while_the_run_trains.py",  # 30 (a 40-step fleet slowed by a sleep, its followers)
    "tests/gate/catches/test_own_fleet_exact.py",  # 45
    "tests/gate/catches/test_own_fleet_bf16_model.py",  # 45
    "notebooks/",  # 13 (nbmake: the four notebooks at their defaults, presenting gate_run's gate in a fresh clone)
    "tests/gate/catches/test_ddp_fsdp_loops.py",  # 39
    "tests/gate/catches/test_own_fleet_configs.py",  # 32
    "tests/train/test_fleet.py",  # 29
    "tests/gate/catches/test_seed_recipe.py",  # 28
    "tests/gate/catches/test_ddp_loops_written_from_the_docs.py",  # 26
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, p in enumerate(LONGEST_FIRST) if path == p or (p.endswith("/") and path.startswith(p))),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: within a file, and among the rest, collection order


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    torch.set_num_threads(1)
    yield


@pytest.fixture
def cyclic_corpus(tmp_path: Path) -> Path:
    """bytes 0..15 repeated: perfectly predictable after one cycle (4800 bytes)."""
    path = tmp_path / "cyclic.bin"
    path.write_bytes(bytes(range(16)) * 300)
    return path
