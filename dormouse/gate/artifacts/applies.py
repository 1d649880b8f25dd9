"""Which references a gate run needs, from its recorded settings (the one
place that says so), and the fields its artifacts' provenance and profile
are compared by."""

from __future__ import annotations

from dormouse.errors import DormouseError
from dormouse.gate.artifacts.layout import EXACT, FLOOR, GRADREF, SINGLE

# Settings that say how the global batch is cut among the fleet's ranks (and
# whether the fleet stops and resumes at another world): the one-process
# references (single, exact) depend on them only through the global batch, so
# they are compared with the fleet through it (normalised to the fleet's profile).
PROFILE_FIELDS = ("world", "batch", "capacity", "profile", "resume_world")

# Settings of the fleet's launch alone (how its ranks hold and reduce the gradient): no one-process
# reference reads them (notebook 01 has no such parameter), so a one-process reference is neither
# stale nor another run for them.
FLEET_LAUNCH_FIELDS = ("shard", "bucket_mb")


# Provenance keys every artifact of one gate run must share.
PROVENANCE = ("dormouse", "source", "torch", "device", "threads", "cpu_capability", "ns_kernel", "corpus", "init")


def references(settings: dict) -> list[str]:
    """The gate's own references a verdict on its fleet needs, from the
    settings its recording keeps (GateSettings.record()): gradref always;
    single and its floor when the fleet's profile has one global batch
    (`global_batch` not None: one window length, so one process can hold it;
    a run from resume_from resumes it too); exact under reduce "exact" beside
    single. The one-process reference every recording gets (reference/) is
    needed too. From the settings alone, never from the other artifacts under
    judgement (a recording that lost a reference must not make it optional)."""
    if not isinstance(settings, dict) or "global_batch" not in settings or "reduce" not in settings:
        raise DormouseError("the settings record no global_batch or reduce (made by older code): re-run every mode")
    need = [GRADREF]
    if settings["global_batch"] is not None:
        need = [SINGLE, FLOOR] + need
        if settings["reduce"] == "exact":
            need.append(EXACT)
    return need
