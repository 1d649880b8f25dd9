"""Fact: everything compared was made by the same code, torch, device, corpus and initial
parameters, from the settings judged against, and every reference that applies is present.

The gate's own fleet (trace format, judged by entry.judge until the fleet's recording replaces it):

complete   every reference that applies is present: gradref, replay, init;
           single when the profile has one global batch; exact under
           reduce="exact". A missing one is a FAIL ("incomplete: no gradref").
           Which apply comes from the settings (the caller's, else those rank 0
           was launched with) by artifacts.references, never from what the
           other artifacts say of themselves.
provenance every artifact was made by the same code (source hash), torch,
           device, threads, CPU capability, corpus and initial parameters,
           with the same settings.

config     the fleet trained the network and recipe the settings give (its
           recorded configuration, every leg, against the reference's; the
           replay too runs the settings' recipe, never the fleet's record).
"""

from __future__ import annotations

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import (
    LEG1,
    ONE_PROCESS,
    PROFILE_FIELDS,
    PROVENANCE,
    ArtifactSet,
    references,
)
from dormouse.gate.judge.facts.series import settings_of
from dormouse.gate.judge.verdict import Check
from dormouse.gate.artifacts.layout import rank_name


def check_complete(a: ArtifactSet, s=None) -> Check:
    need = references(settings_of(a, s))
    missing = [n for n in need if not a.has(n)]
    if missing:
        return Check("complete", False, "incomplete: no " + ", no ".join(missing)
                     + " (run those modes: a missing reference is never a pass)")
    return Check("complete", True, "every reference that applies is present: " + ", ".join(need))



def _global_batch(a: ArtifactSet, name: str) -> tuple[int, list[int]]:
    """(windows, window lengths) of one global step: a one-process
    reference's own batch, or the sum over the fleet's ranks."""
    m = a.meta(name)
    if name in ONE_PROCESS:
        train = m.get("config", {}).get("train", {})
        return m.get("global_batch", train.get("batch")), [train.get("seq_len")]
    shapes = m.get("rank_shapes", [])
    return sum(b for b, _ in shapes), sorted({t for _, t in shapes})



def check_provenance(a: ArtifactSet, names: list[str], s=None) -> Check:
    """Every artifact's provenance equal to rank0's, and its recorded settings
    equal to the settings judged against (`s`; None: rank0's own); the
    one-process references' normalised to the fleet's profile (compared
    through the global batch)."""
    ref = a.meta("rank0")
    want = s.record() if s is not None else ref.get("settings")
    diffs = []
    for n in names:
        m = a.meta(n)
        mine, theirs = m.get("settings") or {}, want or {}
        gb, t = _global_batch(a, n) if n in ONE_PROCESS else (None, None)
        if gb is not None:  # normalised to the fleet's profile: compared through the global batch
            fleet_gb, fleet_t = _global_batch(a, "rank0")
            if t == [None]:
                t = fleet_t[:1]  # no window length recorded: the batch alone is compared
            if gb != fleet_gb or t != fleet_t:
                profile = ",".join(f"{b}x{tt}" for b, tt in ref.get("rank_shapes", []))
                diffs.insert(0, f"{n} ran a global batch of {gb} windows of {t[0]} tokens, the fleet {fleet_gb} "
                             f"({profile} over its ranks): run {n} at the fleet's global batch "
                             f"(single --batch {fleet_gb})")
                continue
            mine, theirs = ({k: v for k, v in d.items() if k not in PROFILE_FIELDS} for d in (mine, theirs))
        for k in PROVENANCE:
            if m.get("provenance", {}).get(k) != ref.get("provenance", {}).get(k):
                diffs.append(f"{n}'s {k} {m.get('provenance', {}).get(k)!r} differs from rank0's "
                             f"{ref.get('provenance', {}).get(k)!r}")
        if mine != theirs:
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            diffs.append(f"{n} was made with other settings ({', '.join(keys)})")
    if diffs:
        return Check("provenance", False, "not comparable: " + "; ".join(diffs[:4])
                     + (" (artifacts from other code: re-run every mode)" if any("source" in d for d in diffs)
                        else "")
                     + (" (give the verdict the settings the run was made with)"
                        if s is not None and any(d.startswith("rank0 was made") for d in diffs) else ""))
    return Check("provenance", True, f"{len(names)} artifacts made by the same code, torch, device, threads, "
                 "corpus and initial parameters, with the same settings")



# Fields of a run that say where and how it ran, not what it computes (the
# corpus is compared by its hash in the provenance, not by its path).
RUN_IDENTITY = ("data", "batch", "ckpt_name", "ckpt_every", "out_dir", "resume", "resume_from", "stop_at", "dist",
                "dist_profile", "dist_shard", "dist_reduce", "dist_bucket_mb", "micro_batch", "log_every")



def check_config(a: ArtifactSet, reference: str) -> Check:
    """The fleet trained the network and recipe the settings give: its
    recorded configuration (every leg) against the reference's, field by field."""
    want = a.meta(reference)["config"]
    diffs = []
    for n in [rank_name(0)] + a.ranks(LEG1)[:1]:
        have = a.meta(n)["config"]
        for section in ("model", "train"):
            for k, v in want[section].items():
                if not (section == "train" and k in RUN_IDENTITY) and have[section].get(k) != v:
                    diffs.append(f"{n}'s {section}.{k} = {have[section].get(k)!r}, {reference}'s {v!r}")
    if diffs:
        return Check("config", False, "the fleet trained another configuration than the settings give: "
                     + "; ".join(diffs[:4]))
    return Check("config", True, f"the fleet trained the settings' network and recipe (every model and training "
                 f"field equal to {reference}'s)")



def provenance(rec: A.RecordingSet) -> dict:
    """The verdict's provenance (docs/verdict.schema.json's keys): the
    recording's code, torch, device and threads; "corpus" the sha256 of every
    micro-batch the fleet read (step JSONs and input tensors, in step and rank
    order), "init" the fingerprint of the recorded initial state."""
    import hashlib as _h

    p = dict(rec.meta.get("provenance", {}))
    h = _h.sha256()
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            for key, t in sorted(rec.step_tensors(r, k).items()):
                if key.startswith("in/") or key == "ids":
                    h.update(f"{k}:{r}:{key}:{tuple(t.shape)}".encode())
                    h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    p.update({"corpus": h.hexdigest(), "init": A.fingerprint(rec.init())})
    for key, default in (("dormouse", ""), ("source", "0" * 64), ("cpu_capability", ""), ("device", "cpu"),
                         ("threads", 1)):
        p.setdefault(key, default)
    return p
