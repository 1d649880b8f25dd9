"""One rank of the exact-reduce fleets of tests/train/test_exact.py (run under torchrun).

argv[1] is a JSON plan: a list of runs, each {"out": dir, "steps", "batch",
"profile", "lr", "reduce", "resume_from", "train": {other TrainConfig fields}},
run one after another in the same process group (one launch, several
fleets). Each rank writes <out>/rank<r>.safetensors (every parameter and
buffer by name) and <out>/rank<r>.json (the run's losses).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/support, however the script is run
from runs import make_run  # noqa: E402
from dormouse.train.distributed import close_fleet, train_dist  # noqa: E402
from dormouse.train.tensors import named_state  # noqa: E402


def fleet_run(entry: dict):
    run = make_run(Path(entry["out"]), steps=entry["steps"], batch=entry["batch"], profile=entry.get("profile", ""),
                   dist=True, lr=entry["lr"], reduce=entry["reduce"], resume_from=entry.get("resume_from", ""))
    run.train = dataclasses.replace(run.train, **entry.get("train", {}))
    return run


def main(plan_file: str) -> None:
    for entry in json.loads(Path(plan_file).read_text()):
        run = fleet_run(entry)
        report = train_dist(run, log=lambda _: None, close=False)
        out, r = Path(entry["out"]), report["rank"]
        state = named_state(report["model"], gather=run.train.dist_shard == "fsdp")  # FSDP2: whole tensors
        save_file(state, str(out / f"rank{r}.safetensors"))
        (out / f"rank{r}.json").write_text(json.dumps({"losses": report["losses"], "world": report["world_size"],
                                                       "start_step": report["start_step"]}))
    close_fleet()


if __name__ == "__main__":
    main(sys.argv[1])
