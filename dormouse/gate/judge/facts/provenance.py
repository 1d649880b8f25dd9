"""Fact: everything compared was made by the same code, torch, device, corpus and initial
parameters, from the settings judged against, and every reference that applies is present.

dormouse's own gate (its fleet's recording, and its references in reference/):

complete   every reference that applies is present: gradref always; single
           and its floor when the profile has one global batch; exact under
           reduce="exact". A missing one is a FAIL ("incomplete: no gradref").
           Which apply comes from the settings (the caller's, else those the
           fleet recorded) by artifacts.references, never from what the other
           artifacts say of themselves.
provenance every reference was made by the same code (source hash), torch,
           device, threads, CPU capability, corpus and initial parameters as
           the fleet, with the same settings.
config     the fleet trained the network and recipe the settings give (its
           recorded configuration against gradref's, made from the settings):
           the recording's replay runs the fleet's own recipe, so a fleet at
           another lr, schedule or clip is caught here.
"""

from __future__ import annotations

import torch

from dormouse.digest import fingerprint
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import (FLEET_LAUNCH_FIELDS, GRADREF, PROFILE_FIELDS, PROVENANCE, GateReferences,
                                      references)
from dormouse.gate.judge.verdict import Check


def gate_settings(rec: A.RecordingSet, s=None) -> dict | None:
    """The settings a verdict on the gate's fleet judges against, as its
    recording keeps them: the caller's (the drivers pass the settings the run
    was asked for), else those the fleet recorded; None: not the gate's fleet."""
    if s is not None:
        return s.record()
    return rec.extra.get("settings")


def check_complete(refs: GateReferences, settings: dict) -> Check:
    need = references(settings)
    missing = [n for n in need if not refs.has(n)]
    if missing:
        return Check("complete", False, "incomplete: no " + ", no ".join(missing)
                     + " (run those modes: a missing reference is never a pass)")
    return Check("complete", True, "every reference that applies is present: " + ", ".join(need)
                 + ", and the recording's own")


def _made(refs: GateReferences, name: str) -> dict:
    """A gate reference's settings and provenance (a recording's extra, or its JSON)."""
    rec = refs.recording(name) if name in (A.SINGLE, A.EXACT) else None
    return rec.extra if rec is not None else (refs.meta(name) or {})


def check_provenance(rec: A.RecordingSet, refs: GateReferences, settings: dict) -> Check:
    """Every gate reference's provenance equal to the fleet's, and every
    recorded settings (the fleet's too) equal to the settings judged against."""
    mine = rec.extra.get("provenance") or {}
    diffs = []
    if rec.extra.get("settings") != settings:
        have = rec.extra.get("settings") or {}
        keys = sorted(k for k in set(have) | set(settings) if have.get(k) != settings.get(k))
        diffs.append(f"the fleet was made with other settings ({', '.join(keys)}): give the verdict the settings "
                     "the run was made with")
    names = refs.present
    for n in names:
        made = _made(refs, n)
        for k in PROVENANCE:
            if (made.get("provenance") or {}).get(k) != mine.get(k):
                diffs.append(f"{n}'s {k} {(made.get('provenance') or {}).get(k)!r} differs from the fleet's "
                             f"{mine.get(k)!r}")
        have, want = made.get("settings") or {}, settings
        if n in A.ONE_PROCESS:  # the fleet's profile normalised away, compared through the global batch (a
            # single made by hand at --batch 4 is the reference of a 2-rank --batch 2 fleet)
            if have.get("global_batch") != want.get("global_batch"):
                diffs.insert(0, f"{n} ran a global batch of {have.get('global_batch')} windows, the fleet "
                             f"{want.get('global_batch')} (profile {want.get('profile') or repr('')} over "
                             f"{want.get('world')} ranks): run {n} at the fleet's global batch "
                             f"(single --batch {want.get('global_batch')})")
                continue
            # the windows' lengths too, not only their count
            if n in (A.SINGLE, A.EXACT) and _lengths(refs.recording(n)) != _lengths(rec):
                diffs.insert(0, f"{n} read windows of {_lengths(refs.recording(n))} bytes, the fleet "
                             f"{_lengths(rec)}: the same global batch in windows, not in tokens")
                continue
            have, want = ({k: v for k, v in d.items() if k not in PROFILE_FIELDS + FLEET_LAUNCH_FIELDS}
                          for d in (have, want))
        if have != want:
            keys = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
            diffs.append(f"{n} was made with other settings ({', '.join(keys)})")
    if diffs:
        return Check("provenance", False, "not comparable: " + "; ".join(diffs[:4])
                     + (" (artifacts from other code: re-run every mode)" if any("source" in d for d in diffs)
                        else ""))
    return Check("provenance", True, f"the fleet and {len(names)} references made by the same code, torch, device, "
                 "threads, corpus and initial parameters, with the same settings")


def _lengths(rec: A.RecordingSet) -> list[int]:
    """The window lengths (the forward's first argument's last dimension) of the recording's first step."""
    return sorted({int(b["arg0"].shape[-1]) for _, _, b in rec.micro_batches(rec.steps[0]) if "arg0" in b})


# Fields of a run that say where and how it ran, not what it computes (the
# corpus is compared by its hash in the provenance, not by its path).
RUN_IDENTITY = ("data", "batch", "ckpt_name", "ckpt_every", "out_dir", "resume", "resume_from", "stop_at", "dist",
                "dist_profile", "dist_shard", "dist_reduce", "dist_bucket_mb", "micro_batch", "log_every")


def check_config(rec: A.RecordingSet, refs: GateReferences) -> Check:
    """The fleet trained the network and recipe the settings give: its
    recorded configuration against gradref's (made from the settings), field by field."""
    want = (refs.meta(GRADREF) or {}).get("config") or {}
    have = rec.spec.build_kwargs.get("run") or {}
    diffs = []
    for section in ("model", "train"):
        for k, v in (want.get(section) or {}).items():
            if not (section == "train" and k in RUN_IDENTITY) and (have.get(section) or {}).get(k) != v:
                diffs.append(f"the fleet's {section}.{k} = {(have.get(section) or {}).get(k)!r}, the settings' {v!r}")
    if diffs:
        return Check("config", False, "the fleet trained another configuration than the settings give: "
                     + "; ".join(diffs[:4]))
    return Check("config", True, "the fleet trained the settings' network and recipe (every model and training "
                 "field equal to gradref's)")


def provenance(rec: A.RecordingSet) -> dict:
    """The verdict's provenance (docs/verdict.schema.json's keys): the
    recording's code, torch, device and threads; "corpus" the sha256 of every
    micro-batch the fleet read (step JSONs and input tensors, in step and rank
    order), "init" the fingerprint of the recorded initial state."""
    import hashlib as _h

    p = dict(rec.recorded.provenance)
    h = _h.sha256()
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            tensors = rec.step_tensors(r, k)  # read one at a time: the inputs only
            for key in sorted(tensors):
                if key.startswith(A.INPUT) or key == "ids":
                    t = tensors[key]
                    h.update(f"{k}:{r}:{key}:{tuple(t.shape)}".encode())
                    h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    p.update({"corpus": h.hexdigest(), "init": fingerprint(rec.init())})
    for key, default in (("dormouse", ""), ("source", "0" * 64), ("cpu_capability", ""), ("device", "cpu"),
                         ("threads", 1)):
        p.setdefault(key, default)
    return p
