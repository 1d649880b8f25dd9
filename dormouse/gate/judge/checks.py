"""The judge: pure functions from a gate run's artifacts to typed results. It
trains nothing (the references, the replay included, are artifacts the
running side produced) and writes nothing.

What a PASS claims: this fleet trains the network one process would train at
the global batch. The checks, each against a reference that shares as little
code as possible with the fleet:

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
finite     no NaN or inf in any compared series.
ranks      every rank's tensors and losses bitwise equal to rank 0's.
window     fact 1, the premise: at every step the batch's gradient equals
           sum_w t_w g(window w alone) / T and its per-token losses equal
           each window's alone, within WINDOW_RTOL (else the network depends
           on which windows share a batch).
gradref    fact 3: at every step the fleet's reduced gradient equals the
           hand-computed token-weighted gradient over bytes gradref read
           itself (GRAD_RTOL; bf16 wire: the elementwise rounding bound), and
           the expert loads the fleet applied equal the ones gradref counted.
bias       bf16 wire only: the fleet's differences from gradref, scaled by their
           rounding bound, average to zero within BIAS_SIGMAS standard errors
           along an offset, a scale and a decay direction (round-to-nearest is
           unbiased; a systematic error far below the bound is not).
loss       the logged loss: at every step the fleet's reported loss equals the
           token-weighted mean of gradref's per-token losses, and every eval
           loss gradref's over the held-out windows, within LOSS_RTOL ("the
           logged loss is wrong"), with or without a single process.
replay     fact 4: the fleet's whole run replayed in one process from init,
           on the fleet's own recorded gradients and gradref's loads, equals
           the fleet's parameters and routing bias BITWISE at every step, its
           final tensors, and its optimizer state at the mid-run checkpoint.
curve      fact 2 at the global batch: per-step loss within a tolerance from
           the reference's floor runs, nudged by one ulp at the start or at
           every step's gradient (under the bf16 wire: every step's gradient
           rounded to bfloat16 as the wire rounds, independent draws) (10 x
           their running maximum, at least CURVE_MIN_RTOL; never from a run that
           splits the batch), the first step's gradients within GRAD_RTOL
           (both start from the same parameters), and every tensor within its
           own floor at every step (the routing bias excepted: discrete,
           judged by routing flips). A divergence is excused as round-off after
           a routing flip only before any per-step check failed; else the
           summary names the first failing check and step.
exact      fact 2 exactly: under reduce="exact" every step's parameters,
           gradients and loss bitwise equal to the exact reference, else the
           first step, tensor and element, with the difference in ulps.

What no reference can see: code shared by the fleet and every reference (the
optimizer's internals, the lr schedule, the data rule's own helpers are used
by the fleet, but gradref re-derives the bytes). Unit tests and bitwise parity
with torch's optimizers cover those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dormouse.errors import DormouseError
from dormouse.gate.artifacts import LEG1, ONE_PROCESS, PROFILE_FIELDS, PROVENANCE, ArtifactSet, references
from dormouse.gate.layout import INIT, rank_name
from dormouse.gate.judge.steps import routing_flips
from dormouse.numerics import rel_per_step

from dormouse.gate.judge.bounds import (BF16_MODEL_RTOL, BF16_UNIT_ROUNDOFF, BIAS_FLOOR, BIAS_SIGMAS,  # noqa: F401
                                        CURVE_MIN_RTOL, FLOOR_MULTIPLE, GRAD_RTOL, LOSS_RTOL, WINDOW_RTOL,
                                        floor_bound)
from dormouse.gate.judge.verdict import (VERDICT_SCHEMA, Check, CurveCheck, ExactCheck, TensorCheck,  # noqa: F401
                                         Verdict, finite as _finite)

BIAS = "router_bias"  # tensors whose name ends so are discrete: judged by routing flips


def arithmetic_rtol(config: dict, float32: float = GRAD_RTOL) -> float:
    """The gradient bound of a run's arithmetic: `float32`, or BF16_MODEL_RTOL
    when its (the settings') configuration trains a bfloat16 model."""
    return BF16_MODEL_RTOL if config.get("model", {}).get("bf16") else float32


# --------------------------------------------------------------------------- helpers


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (max |a - b| where b is all zero)."""
    a, b = a.double(), b.double()
    if not b.numel():
        return 0.0
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest number of representable floats between a and b, element by
    element (float32; float64 for float64 inputs): 1 for float neighbours."""
    dtype, itype = (torch.float64, torch.int64) if torch.float64 in (a.dtype, b.dtype) else (torch.float32, torch.int32)

    def ordered(x):  # the bit patterns, made monotone in the value
        i = x.to(dtype).contiguous().view(itype).to(torch.int64)
        if itype == torch.int32:
            return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
        return torch.where(i < 0, -(i & 0x7FFFFFFFFFFFFFFF), i)

    return float((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0.0


def _series_names(trace: dict, prefix: str) -> list[str]:
    return sorted(k[len(prefix):] for k in trace if k.startswith(prefix))


def _running_max(xs: list[float]) -> list[float]:
    out, top = [], 0.0
    for x in xs:
        top = max(top, x)
        out.append(top)
    return out


def _tolerance(envelope: list[float], multiple: float = FLOOR_MULTIPLE) -> list[float]:
    return [floor_bound(e, CURVE_MIN_RTOL, multiple) for e in envelope]


# `settings` below: the gate's settings (a dormouse.gate.settings.GateSettings,
# or anything whose .record() gives what its artifacts record); the judge
# reads them only as that record.


def required(settings) -> list[str]:
    """The references a verdict for `settings` needs (artifacts.references of their record)."""
    return references(settings.record())


def settings_of(a: ArtifactSet, settings=None) -> dict:
    """The settings a verdict judges against, as artifacts record them: the
    caller's (the drivers pass the settings the run was asked for), else
    those the fleet's rank 0 was launched with. Every artifact's recorded
    settings must equal them (the provenance check)."""
    if settings is not None:
        return settings.record()
    record = a.meta("rank0").get("settings")
    if not isinstance(record, dict):
        raise DormouseError("rank0.json records no settings: re-run the rank mode")
    return record


# --------------------------------------------------------------------------- checks


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


def check_finite(a: ArtifactSet, names: list[str]) -> Check:
    for n in names:
        m = a.meta(n)
        bad = [i + 1 for i, x in enumerate(m.get("losses", [])) if not math.isfinite(x)]
        if bad:
            return Check("finite", False, f"{n}'s loss is not finite at step {bad[0]}")
        for source in (a.trace(n) if n != "gradref" else None, a.tensors(n)):
            for k, t in (source or {}).items():
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    return Check("finite", False, f"{n}'s {k} holds NaN or inf")
    return Check("finite", True, "every compared series is finite")


def check_ranks(a: ArtifactSet) -> Check:
    legs = a.meta("rank0").get("legs") or [[a.meta("rank0").get("world_size"), None]]
    bad, worlds = [], []
    for prefix, (world, _) in zip([LEG1, ""] if len(legs) == 2 else [""], legs):
        names = a.ranks(prefix)
        worlds.append(len(names))
        if len(names) != world:
            return Check("ranks", False, f"found {len(names)} {prefix}rank artifacts for a world of {world}")
        bad += _unequal_ranks(a, names)
    if bad:
        return Check("ranks", False, "ranks differ: " + "; ".join(bad))
    sharded = a.meta("rank0")["settings"].get("shard") == "fsdp"
    note = (" (FSDP2: gathered tensors are equal by construction; this catches buffers gone apart)"
            if sharded else "")
    legs_note = f" in each leg (worlds {worlds[0]} then {worlds[1]})" if len(worlds) == 2 else ""
    if len(worlds) == 1 and len({t for _, t in a.meta("rank0").get("rank_shapes", [])}) > 1:
        legs_note = " (one launch, no stop and resume: the profile mixes window lengths)"
    return Check("ranks", True, f"all ranks bitwise equal{legs_note}{note}")


def unequal_to_first(a: ArtifactSet, names: list[str]) -> dict[str, list[str] | None]:
    """Per rank artifact after the first: None when its losses and every tensor
    are bitwise the first's, else the unequal tensors, largest difference first
    (the tensor that went apart, not those it dragged along; [] when only the
    losses differ)."""
    if not names:
        return {}
    ref, ref_losses = a.tensors(names[0]), a.meta(names[0])["losses"]
    out: dict[str, list[str] | None] = {}
    for n in names[1:]:
        t = a.tensors(n)
        unequal = [k for k in ref if k not in t or not torch.equal(ref[k], t[k])]
        unequal.sort(key=lambda k: -relative(t[k], ref[k]) if k in t else -math.inf)
        out[n] = unequal if unequal or a.meta(n)["losses"] != ref_losses else None
    return out


def _unequal_ranks(a: ArtifactSet, names: list[str]) -> list[str]:
    return [f"{n} vs {names[0]}: {', '.join(u[:3]) or 'losses'}"
            for n, u in unequal_to_first(a, names).items() if u is not None]


def _per_step_tensor(name: str, series_a: dict, series_b: dict, names: list[str], bound, *,
                     what: str) -> TensorCheck:
    """Compare two per-step tensor series (name -> (steps, ...)) under a
    per-(tensor, step) bound function; the first violation fails."""
    steps = min(len(series_a[names[0]]), len(series_b[names[0]])) if names else 0
    per_step, worst, where, first_bad = [], -1.0, (None, None), None
    for k in range(steps):
        top = 0.0
        for n in names:
            r = relative(series_a[n][k], series_b[n][k])
            lim = bound(n, k)
            if not r <= lim and first_bad is None:
                first_bad = (k + 1, n, r, lim)
            top = max(top, r)
            if r > worst:
                worst, where = r, (n, k + 1)
        per_step.append(top)
    if first_bad:
        k, n, r, lim = first_bad
        return TensorCheck(name, False, f"{what} at step {k}: {n} off by {r:.2e} > {lim:.1e}",
                           worst, where[0], where[1], lim, per_step, first_step=k)
    lim = bound(where[0], 0) if where[0] else 0.0
    return TensorCheck(name, True, f"{what}: max relative difference {max(worst, 0):.2e} ({where[0]}, step "
                       f"{where[1]}) within {lim:.0e} at every step", max(worst, 0), where[0], where[1], lim, per_step)


def check_window(a: ArtifactSet) -> Check:
    g = a.tensors("gradref")
    names = _series_names(g, "g/")
    batch = {n: g[f"b/{n}"] for n in names}
    window = {n: g[f"g/{n}"] for n in names}
    rtol = arithmetic_rtol(a.meta("gradref").get("config", {}), WINDOW_RTOL)
    c = _per_step_tensor("window", batch, window, names, lambda n, k: rtol,
                         what="the batch's gradient against the sum of each window's alone")
    losses = relative(g["batch_losses"], g["window_losses"])
    if not c.passed:
        c.reason = ("the network depends on which windows share a batch (a fleet that splits the batch "
                    "trains another network): " + c.reason)
    elif losses > rtol:
        steps = [k + 1 for k in range(len(g["batch_losses"]))
                 if relative(g["batch_losses"][k], g["window_losses"][k]) > rtol]
        c.passed, c.first_step = False, steps[0]
        c.reason = (f"the network depends on which windows share a batch: per-token losses of the batch "
                    f"differ from each window's alone by {losses:.2e} (first at step {steps[0]})")
    else:
        c.reason += f"; per-token losses within {losses:.1e}"
    return c


def check_gradref(a: ArtifactSet) -> Check:
    fleet, g = a.trace("rank0"), a.tensors("gradref")
    meta = a.meta("rank0")
    names = _series_names(g, "g/")
    if fleet is None or not all(f"g/{n}" in fleet for n in names):
        return TensorCheck("gradref", False, "the fleet recorded no per-step gradients (rank0 trace)")
    steps_f, steps_g = len(fleet[f"g/{names[0]}"]), len(g[f"g/{names[0]}"])
    if steps_f != steps_g:
        return TensorCheck("gradref", False, f"gradref covers {steps_g} steps, the fleet ran {steps_f}: re-run gradref")
    fg = {n: fleet[f"g/{n}"] for n in names}
    gg = {n: g[f"g/{n}"] for n in names}
    wire = meta["settings"].get("reduce", "fp32")
    rtol = arithmetic_rtol(a.meta("gradref").get("config", {}))
    if wire == "bf16":
        def bound(n, k):  # elementwise W u sum|t g|/T, as a ratio of the scale max|g|
            scale = gg[n][k].abs().max().item() or 1.0
            return (world_at(meta, k) * BF16_UNIT_ROUNDOFF * g[f"a/{n}"][k].abs().max().item()) / scale + rtol
    else:
        def bound(n, k):
            return rtol
    c = _per_step_tensor("gradref", fg, gg, names, bound,
                         what="the fleet's reduced gradient against the hand-computed token-weighted gradient")
    if c.passed and all(f"a/{n}" in g for n in names):
        if a.meta("gradref").get("config", {}).get("model", {}).get("bf16"):
            c.reason += ("; exact zeros not checked (a bfloat16 model: a window's gradient can round to an "
                         "exact zero where the fleet's batched one does not)")
        else:
            _check_structural_zeros(c, fg, {n: g[f"a/{n}"] for n in names}, names)
    if c.passed and "loads" in g and "loads" in fleet:
        diff = [k + 1 for k in range(min(len(g["loads"]), len(fleet["loads"])))
                if not torch.equal(g["loads"][k], fleet["loads"][k])]
        if diff:
            c.passed, c.first_step = False, diff[0]
            c.reason = (f"the expert loads the fleet applied differ from those counted over every rank's "
                        f"tokens at step {diff[0]} (the routing bias moved by other loads)")
        else:
            c.reason += "; expert loads equal at every step"
    return c


def _check_structural_zeros(c: TensorCheck, fleet: dict, absref: dict, names: list[str]) -> None:
    """Exactly, beside the relative bound: wherever every window's gradient is
    exactly zero (gradref's sum of |t g| over the windows is 0: an embedding
    row of a byte the step never read, LoRA A while B is 0, an expert no
    token chose), the fleet's reduced gradient must be exactly zero too, since
    any reduce of zeros, in any order, at any width, gives zero. In float32
    arithmetic only: in a clean bfloat16-model fleet 2 elements of
    embed.weight were exactly zero in every window's gradient at step 1 and
    not in the fleet's batched one (bfloat16 rounding; the mechanism not
    pinned down), so a bfloat16 model is not held to it. The relative
    bound is scaled by the tensor's largest element and lets a small made-up
    value through there, and Adam turns any nonzero into a step of ~lr (a
    review's fleet that filled zeros with 4e-6 max|g| sign(p) passed under
    mixed window lengths, where no curve applies). Fails `c` at the first
    step and tensor where it does not hold."""
    zeros = 0
    for k in range(len(fleet[names[0]])):
        for n in names:
            mask = absref[n][k] == 0
            stray = int((fleet[n][k][mask] != 0).sum())
            if stray:
                c.passed, c.first_step = False, k + 1
                c.reason = (f"the fleet's reduced gradient is nonzero at {stray} element(s) of {n} at step {k + 1} "
                            f"where every window's gradient is exactly zero (nothing there to reduce: the fleet "
                            f"made gradient up)")
                return
            zeros += int(mask.sum())
    c.reason += f"; exactly zero wherever every window's gradient is ({zeros} element-steps)"


def check_loss(a: ArtifactSet) -> Check:
    """The logged loss. At every step the fleet's reported loss must equal the
    token-weighted mean of gradref's per-token losses at the same parameters,
    sum_i l_i / T over the step's T tokens (gradref reads the bytes and
    counts the tokens itself), within LOSS_RTOL; every eval loss it reported
    must equal gradref's mean over the held-out windows at the fleet's
    parameters after that step, at the steps the recipe evaluates (a
    bfloat16 model: within BF16_MODEL_RTOL, its own round-off). Apart from
    the gradient checks, and whether or not a single process applies: a
    fleet can train right and log a wrong curve, which misleads as much."""
    fleet, g, gm = a.meta("rank0"), a.tensors("gradref"), a.meta("gradref")
    tol = arithmetic_rtol(gm.get("config", {}), LOSS_RTOL)  # a bfloat16 model's own round-off is wider
    if "window_losses" not in g:
        return TensorCheck("loss", False, "gradref holds no per-token losses: re-run gradref", first_step=1)
    ref = g["window_losses"].double().mean(dim=1).tolist()
    lf = fleet["losses"]
    if len(ref) != len(lf):
        return TensorCheck("loss", False, f"the fleet logged {len(lf)} losses, gradref covers {len(ref)} steps: "
                           "re-run gradref", first_step=1)
    rel = [abs(f - r) / abs(r) if r else abs(f - r) for f, r in zip(lf, ref)]
    worst = max(range(len(rel)), key=lambda k: rel[k]) if rel else 0
    c = TensorCheck("loss", True, "", worst=max(rel, default=0.0), worst_step=worst + 1, bound=tol,
                    per_step=rel)
    bad = next((k for k, r in enumerate(rel) if not r <= tol), None)
    if bad is not None:
        c.passed, c.first_step = False, bad + 1
        c.reason = (f"the logged loss is wrong: at step {bad + 1} the fleet reported {lf[bad]:.7f}, the "
                    f"token-weighted mean of the step's per-token losses is {ref[bad]:.7f} (relative "
                    f"{rel[bad]:.1e} > {tol:.0e}); its gradients are judged apart")
        return c
    c.reason = (f"the logged loss equals the token-weighted mean of gradref's per-token losses within "
                f"{max(rel, default=0.0):.1e} at every step (<= {tol:.0e})")
    want, have = gm.get("evals"), fleet.get("evals") or []
    if want is None:
        return c
    if [k for k, _ in have] != [k for k, _ in want]:
        c.passed, c.first_step = False, (want or have)[0][0]
        c.reason = (f"the logged eval loss is wrong: the fleet reported eval losses at steps "
                    f"{[k for k, _ in have]}, the recipe evaluates at steps {[k for k, _ in want]}")
        return c
    erel = [abs(x - y) / abs(y) if y else abs(x - y) for (_, x), (_, y) in zip(have, want)]
    bad = next((i for i, r in enumerate(erel) if not r <= tol), None)
    if bad is not None:
        c.passed, c.first_step = False, want[bad][0]
        c.reason = (f"the logged eval loss is wrong: at step {want[bad][0]} the fleet reported "
                    f"{have[bad][1]:.7f}, the held-out windows' token mean at its parameters is "
                    f"{want[bad][1]:.7f} (relative {erel[bad]:.1e} > {tol:.0e})")
        return c
    if want:
        c.reason += f"; eval losses at steps {[k for k, _ in want]} within {max(erel):.1e}"
    return c


@dataclass
class BiasCheck(Check):
    """The bf16 wire's rounding errors, scaled by their bound, along each
    direction a systematic error takes: S (in standard errors) per direction."""

    stats: dict[str, float] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)  # per direction: the mean scaled error (units of the bound)
    samples: int = 0
    smallest: float = 0.0  # the decay-like bias, in units of the bound, that would be caught


def check_bias(a: ArtifactSet) -> BiasCheck:
    """Under the bf16 wire, the rounding is unbiased. Per element e and step k,
    z = (g_fleet - g_ref) / b with b = W u sum_w t_w |g_w| / T (the rounding
    bound gradref's check uses; elements with b = 0 left out). Round-to-nearest
    errors average to zero, also when multiplied by a sign d that does not
    depend on them: for each direction d (1: an offset; sign(g_ref): a scale;
    sign(p) of the parameters before the step: a decay) the statistic

        S = sum_e c_e / sqrt(sum_e c_e^2),   c_e = sum_k d_ek z_ek,

    is a standard normal (errors summed per element first, so an element whose
    errors repeat from step to step counts once: a cluster-robust standard
    error). It fails when |S| > BIAS_SIGMAS and the mean sum_e c_e / N (N
    element-steps) exceeds the direction's BIAS_FLOOR (round-to-nearest's own
    pull towards zero on log-distributed magnitudes stays far below it). A
    bias of beta times the bound along d gives S ~ beta N / sqrt(sum c^2): the
    smallest caught is max(BIAS_SIGMAS sqrt(sum c^2) / N, BIAS_FLOOR[d]), far
    below the per-element bound."""
    fleet, g, meta, init = a.trace(rank_name(0)), a.tensors("gradref"), a.meta(rank_name(0)), a.tensors(INIT)
    names = _series_names(g, "g/")
    directions = ("offset", "scale", "decay")
    num = dict.fromkeys(directions, 0.0)
    den = dict.fromkeys(directions, 0.0)
    count = 0
    for n in names:
        if f"a/{n}" not in g or f"g/{n}" not in fleet or f"p/{n}" not in fleet or n not in init:
            return BiasCheck("bias", False, f"the bias test lacks {n}'s series (fleet trace, gradref's |g| sums "
                             "or init): re-run the modes")
        ref = g[f"g/{n}"].double()
        steps = ref.shape[0]
        world = torch.tensor([float(world_at(meta, k)) for k in range(steps)], dtype=torch.float64)
        b = world.view(-1, *[1] * (ref.dim() - 1)) * BF16_UNIT_ROUNDOFF * g[f"a/{n}"].double()
        d = fleet[f"g/{n}"][:steps].double() - ref
        keep = b > 0
        z = torch.where(keep, d / torch.where(keep, b, torch.ones_like(b)), torch.zeros_like(b))
        before = torch.cat([init[n].unsqueeze(0), fleet[f"p/{n}"][:steps - 1]]).double()
        count += int(keep.sum())
        for name, sign in (("offset", torch.ones_like(z)), ("scale", torch.sign(ref)), ("decay", torch.sign(before))):
            per_element = (sign * z).sum(dim=0)
            num[name] += float(per_element.sum())
            den[name] += float((per_element ** 2).sum())
    stats = {k: num[k] / math.sqrt(den[k]) if den[k] > 0 else 0.0 for k in directions}
    means = {k: num[k] / count if count else 0.0 for k in directions}
    # the smallest bias caught along the decay direction (an extra weight decay: the review's attack)
    smallest = max(BIAS_SIGMAS * math.sqrt(den["decay"]) / count, BIAS_FLOOR["decay"]) if count else math.inf
    biased = [k for k in directions if not (abs(stats[k]) <= BIAS_SIGMAS or abs(means[k]) <= BIAS_FLOOR[k])]
    text = ", ".join(f"{k} {stats[k]:+.1f} ({means[k]:+.1e})" for k in directions)
    c = BiasCheck("bias", True, "", stats=stats, means=means, samples=count, smallest=smallest)
    if biased:
        k = max(biased, key=lambda d: abs(stats[d]))
        c.passed = False
        c.reason = (f"the fleet's reduced gradient is biased beyond the bf16 wire's rounding: its differences from "
                    f"gradref, scaled by their bound, do not average to zero ({k}: {stats[k]:+.1f} standard errors "
                    f"> {BIAS_SIGMAS:g}, mean {means[k]:+.1e} of the bound > {BIAS_FLOOR[k]:.0e}; over {count} "
                    f"element-steps, per direction S (mean): {text})")
    else:
        c.reason = (f"the bf16 wire's rounding errors, scaled by their bound, average to zero along every "
                    f"direction, S in standard errors (mean in units of the bound): {text}, over {count} "
                    f"element-steps; a decay-like bias of {smallest:.1e} x the bound would be caught")
    return c


def world_at(meta: dict, k: int) -> int:
    """The fleet's world size at step k (0-based): a fleet that stopped and
    resumed ran its first leg at another world size."""
    legs = meta.get("legs") or [[meta.get("world_size", 1), None]]
    return legs[0][0] if meta.get("resumed_at") and k < meta["resumed_at"] else legs[-1][0]


def first_difference(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> tuple[str, int, float] | None:
    """The first (tensor, flat element, ulps) that differs, or None."""
    for name, x, y in pairs:
        if not torch.equal(x, y):
            flat = (x.reshape(-1) != y.reshape(-1)).nonzero()
            i = int(flat[0]) if len(flat) else 0
            return name, i, ulps(x.reshape(-1)[i:i + 1], y.reshape(-1)[i:i + 1])
    return None


def _bitwise_steps(name: str, ours: dict, theirs: dict, keys: list[str], steps: int, what: str,
                   losses: tuple[list[float], list[float]] | None = None) -> ExactCheck:
    equal, first = [], None
    for k in range(steps):
        d = first_difference([(key, ours[key][k], theirs[key][k]) for key in keys])
        if d is None and losses is not None and losses[0][k] != losses[1][k]:
            d = ("loss", 0, ulps(torch.tensor([losses[0][k]], dtype=torch.float64),
                                 torch.tensor([losses[1][k]], dtype=torch.float64)))
        equal.append(d is None)
        if d is not None and first is None:
            first = (k + 1, *d)
    if first:
        k, tensor, el, u = first
        return ExactCheck(name, False, f"{what}: first differs at step {k}, {tensor} element {el} "
                          f"({u:.0f} ulps); {sum(equal)} of {steps} steps bitwise equal", equal, k, tensor, el, u)
    return ExactCheck(name, True, f"{what}: bitwise equal at all {steps} steps", equal)


def check_replay(a: ArtifactSet) -> Check:
    fleet, r = a.trace("rank0"), a.tensors("replay")
    keys = sorted(k for k in r if k.startswith("p/"))
    if not all(k in fleet for k in keys):
        return ExactCheck("replay", False, "the fleet's trace lacks per-step tensors")
    steps = min(len(r[keys[0]]), len(fleet[keys[0]]))
    c = _bitwise_steps("replay", fleet, r, keys, steps,
                       "the fleet's run replayed in one process on its own gradients (parameters and routing bias)")
    final = a.tensors("rank0")
    off = [k for k in final if f"p/{k}" in r and not torch.equal(final[k], r[f"p/{k}"][steps - 1])]
    if off:
        c.passed, c.first_step = False, c.first_step or steps
        c.reason += f"; the fleet's final tensors are not its traced last step: {', '.join(off[:3])}"
    state = a.meta("replay").get("optimizer_state")
    if state:
        if state["unequal"] or state["checkpoint_step"] != state["step"]:
            c.passed, c.first_step = False, min(c.first_step or state["step"], state["step"])
            c.reason += (f"; the optimizer state the fleet checkpointed at step {state['checkpoint_step']} is not the "
                         f"replay's at step {state['step']}: {', '.join(state['unequal'][:3])}")
        else:
            c.reason += f"; its optimizer state at the step-{state['step']} checkpoint bitwise ({state['tensors']} tensors)"
    if "grad_norm" in r:
        if "grad_norm" not in fleet:
            c.passed, c.reason = False, "the fleet recorded no gradient norms although it clips"
        else:
            off = relative(fleet["grad_norm"], r["grad_norm"])
            # a bfloat16 model's norm is a bfloat16 number: FSDP2 sums shard norms in another order
            lim = arithmetic_rtol(a.meta("gradref").get("config", {}) if a.has("gradref") else {})
            if not off <= lim:
                scale = r["grad_norm"].double().abs().max()
                over = ((fleet["grad_norm"].double() - r["grad_norm"].double()).abs() / scale > lim).nonzero()
                at = int(over[0]) + 1 if len(over) else 1
                c.passed, c.first_step = False, min(c.first_step or at, at)
                c.reason += f"; the fleet's clipping norm is off the replay's own by {off:.2e} > {lim:.0e}"
            else:
                c.reason += f"; the fleet's clipping norms within {off:.1e} of the replay's own"
    return c


def check_exact(a: ArtifactSet) -> Check:
    fleet, e = a.trace("rank0"), a.trace("exact")
    keys = sorted(k for k in e if k.startswith(("p/", "g/")))
    steps = min(len(e[keys[0]]), len(fleet[keys[0]]))
    c = _bitwise_steps("exact", fleet, e, keys, steps,
                       "every step's parameters, gradients and loss against the exact reference",
                       losses=(a.meta("rank0")["losses"], a.meta("exact")["losses"]))
    if len(a.meta("rank0")["losses"]) != len(a.meta("exact")["losses"]):
        c.passed, c.reason = False, "the exact reference ran another number of steps than the fleet"
    return c


def check_curve(a: ArtifactSet, *, multiple: float = FLOOR_MULTIPLE,
                failed: tuple[str, int] | None = None) -> CurveCheck:
    """The global-batch curve. `failed`: the first per-step check that failed
    (name, step), which no divergence at or after it may be excused by."""
    single, fleet = a.meta("single"), a.meta("rank0")
    ls, lf = single["losses"], fleet["losses"]
    if len(ls) != len(lf) or not lf or single.get("start_step", 0) != fleet.get("start_step", 0):
        return CurveCheck("curve", False, f"single and fleet are not comparable: single ran {len(ls)} steps from "
                          f"step {single.get('start_step', 0)}, the fleet {len(lf)} from {fleet.get('start_step', 0)}")
    wire = fleet["settings"].get("reduce", "fp32")
    runs = single.get("floor", {})
    if wire == "bf16" and not any(k.startswith("wire") for k in runs):
        return CurveCheck("curve", False, "the single process measured no bf16 wire floor (floor runs whose "
                          "gradients are rounded as the wire rounds): re-run single", wire=wire)
    rel = [abs(f - s) / abs(s) if s else abs(f - s) for s, f in zip(ls, lf)]
    floor = [0.0] * len(ls)
    floors: dict[str, list[float]] = {}
    for run in runs.values():
        for k, (x, y) in enumerate(zip(run["losses"], ls)):
            floor[k] = max(floor[k], abs(x - y) / abs(y) if y else abs(x - y))
        for name, series in run["param_rel"].items():
            floors[name] = [max(p, q) for p, q in zip(floors.get(name, [0.0] * len(series)), series)]
    envelope = _running_max(floor)
    tolerance = _tolerance(envelope, multiple)
    if wire == "bf16":
        why = (f"{multiple:g} x the running maximum of {len(runs)} floor runs of the reference: its start nudged "
               f"by one ulp, and {sum(k.startswith('wire') for k in runs)} whose every gradient is rounded to "
               f"bfloat16 as the wire rounds (independent draws), at least {CURVE_MIN_RTOL:.0e}")
    else:
        why = (f"{multiple:g} x the running maximum of {len(runs)} one-ulp nudges of the "
               f"reference (its start; every step's gradient), at least {CURVE_MIN_RTOL:.0e}")
    c = CurveCheck("curve", True, "", wire=wire, single=ls, fleet=lf, per_step=rel, noise_floor=floor,
                   tolerance=tolerance, tolerance_why=why)
    bad = [k for k, (r, t) in enumerate(zip(rel, tolerance)) if not r <= t]
    # Gradients at the first step: both start from the same parameters.
    st, ft = a.trace("single"), a.trace("rank0")
    gnames = _series_names(st, "g/")
    c.grad_step1 = max((relative(ft[f"g/{n}"][0], st[f"g/{n}"][0]) for n in gnames), default=0.0)
    grad_lim = arithmetic_rtol(single["config"]) if wire != "bf16" else max(
        2 * world_at(fleet, 0) * BF16_UNIT_ROUNDOFF, arithmetic_rtol(single["config"], 0.0))
    # Every tensor against its own floor (the routing bias through flips).
    first_param = None
    train, model = single["config"]["train"], single["config"]["model"]  # the settings', not the fleet's
    # Tensors are judged against their own floor where the optimizer's map is
    # float32: bfloat16 Newton-Schulz (or a bf16 model) rounds updates to 8
    # bits, so a few ulps of gradient round-off move a parameter by ~2^-8 of
    # its update; there gradref (every step's gradient) and the bitwise replay
    # (every step's update) carry the proof. The bf16 wire rounds gradients,
    # not the map: its floor runs round them the same way.
    judge_tensors = train.get("ns_dtype") != "bfloat16" and not model.get("bf16")
    for name in _series_names(st, "p/"):
        series = rel_per_step(ft[f"p/{name}"], st[f"p/{name}"])
        c.param_divergence[name] = series
        if name.endswith(BIAS) or not judge_tensors:
            continue
        tol = _tolerance(_running_max(floors.get(name, [0.0] * len(series))), multiple)
        for k, (v, t) in enumerate(zip(series, tol)):
            if not v <= t and (first_param is None or k + 1 < first_param[0]):
                first_param = (k + 1, name, v, t)
                break
    if first_param:
        c.first_divergent_param_step, c.first_divergent_param = first_param[0], first_param[1]
    try:
        flips = _flips(a, st)
        if flips is not None:
            c.routing_flips = flips.tolist()
            c.first_flip_step = next((k + 1 for k, n in enumerate(flips.sum(dim=1).tolist()) if n), None)
    except RuntimeError:  # ranks of different window lengths: not comparable token by token
        pass
    c.summary = _summary(c, bad, first_param, failed)
    top = max(range(len(rel)), key=lambda k: rel[k])
    worst = max(range(len(rel)), key=lambda k: rel[k] / tolerance[k])
    reasons = [f"max per-step relative loss difference {rel[top]:.2e} (step {top + 1}: tolerance "
               f"{tolerance[top]:.1e})" + (f", nearest its tolerance at step {worst + 1} ({rel[worst]:.1e} of "
                                           f"{tolerance[worst]:.1e})" if worst != top else "")]
    if bad:
        reasons.append(f"the loss exceeds its tolerance first at step {bad[0] + 1}")
    if not c.grad_step1 <= grad_lim:
        reasons.append(f"step-1 gradients differ by {c.grad_step1:.2e} > {grad_lim:.0e} (same parameters, "
                       "same bytes: a scale, weighting or split bug)")
    else:
        reasons.append(f"step-1 gradients within {c.grad_step1:.1e}")
    if not judge_tensors:
        reasons.append("tensors reported, not judged (8-bit rounding in the optimizer's map: gradref and the "
                       "replay prove each step)")
    if first_param:
        reasons.append(f"{first_param[1]} leaves its floor at step {first_param[0]} ({first_param[2]:.1e} > "
                       f"{first_param[3]:.1e})")
    c.passed = not bad and c.grad_step1 <= grad_lim and first_param is None and all(map(math.isfinite, lf))
    c.reason = "; ".join(reasons) + f"; {c.summary}"
    return c


def _flips(a: ArtifactSet, st: dict):
    """Routing flips per step and iteration, single vs the fleet's ranks
    joined in rank order (leg by leg for a fleet that stopped and resumed)."""
    legs = [LEG1, ""] if a.ranks(LEG1) else [""]
    parts, start = [], 0
    for prefix in legs:
        traces = [a.trace(n) for n in a.ranks(prefix)]
        if "topk" not in st or not traces or not all(t and "topk" in t for t in traces):
            return None
        fleet = torch.cat([t["topk"] for t in traces], dim=1)
        parts.append(routing_flips(st["topk"][start:start + len(fleet)], fleet))
        start += len(fleet)
    return torch.cat(parts) if start == len(st["topk"]) else None


def _summary(c: CurveCheck, bad: list[int], first_param=None, failed: tuple[str, int] | None = None) -> str:
    """One sentence on where the fleet leaves its floor and why. A divergence
    is explained as round-off amplified by a routing flip only when a flip
    comes first AND no per-step check (window, gradref, loss, bias, replay,
    exact) failed at or before the step it leaves the floor: after a failing
    check the divergence is that fault's, and the summary names it."""
    above = bad[0] + 1 if bad else None
    left = min(x for x in (above, first_param[0] if first_param else None) if x is not None) \
        if (above or first_param) else None
    if left is None:
        return "the fleet stays within the measured floor at every step"
    what = "the loss leaves the floor" if left == above else f"{first_param[1]} leaves its floor"
    if failed is not None and failed[1] <= left:
        return (f"{what} at step {left}, at or after the first failing check: {failed[0]} at step {failed[1]} "
                "(the divergence is that fault's)")
    flips = c.routing_flips
    explained = c.first_flip_step is not None and (c.first_flip_step < left or (
        c.first_flip_step == left and flips and flips[left - 1][0] > 0))
    if explained:
        return (f"{what} at step {left}, after a routing flip (first at step "
                f"{c.first_flip_step}): round-off amplified by a discrete expert choice")
    return f"{what} at step {left} before any routing flip could explain it: suspect the fleet"


def first_failure(checks: list[Check]) -> tuple[str, int] | None:
    """The first per-step check that failed, as (name, step): the earliest
    step, a check without one counting from step 1 (it holds at no step)."""
    hits = [(getattr(c, "first_step", None) or 1, i, c.name) for i, c in enumerate(checks)
            if not c.passed and c.name in STEPWISE]
    if not hits:
        return None
    step, _, name = min(hits)
    return name, step


STEPWISE = ("window", "gradref", "bias", "loss", "replay", "exact")  # checks a curve divergence may not be excused by


# --------------------------------------------------------------------------- the verdict


def judge(out, settings=None) -> Verdict:
    """Every check that applies, over what `out` holds, for `settings` (the
    drivers pass the settings the run was asked for; None: those rank 0 was
    launched with). Which references apply comes from the settings
    (artifacts.references of their record). A
    missing fleet or reference fails; a PASS needs every check to pass."""
    a = ArtifactSet(Path(out))
    if not a.has("rank0"):
        c = Check("complete", False, f"incomplete: no fleet artifacts (rank0.json) in {str(out)!r}: run the rank mode")
        return Verdict(str(out), False, [c], [])
    try:
        s = settings_of(a, settings)
        need = references(s)
    except DormouseError as e:
        c = Check("complete", False, f"cannot tell which references apply: {e}")
        return Verdict(str(out), False, [c], [])
    checks = [check_complete(a, settings)]
    present = [n for n in need if a.has(n)]
    names = a.ranks(LEG1) + a.ranks() + present
    checks.append(check_provenance(a, names, settings))
    if checks[-1].passed and present and (a.has("gradref") or a.has("single")):
        checks.append(check_config(a, "gradref" if a.has("gradref") else "single"))
    if checks[1].passed:
        checks.append(check_finite(a, names))
        checks.append(check_ranks(a))
        if a.has("gradref"):
            checks.append(check_window(a))
            checks.append(check_gradref(a))
            if s["reduce"] == "bf16" and not a.meta("gradref").get("config", {}).get("model", {}).get("bf16"):
                checks.append(check_bias(a))  # (a bfloat16 model's own arithmetic is no wire rounding)
            checks.append(check_loss(a))
        if a.has("replay"):
            checks.append(check_replay(a))
        exact = check_exact(a) if a.has("exact") else None
        if a.has("single") and "single" in need:
            checks.append(check_curve(a, failed=first_failure(checks + ([exact] if exact else []))))
        if exact:
            checks.append(exact)
    ok = all(c.passed for c in checks)
    return Verdict(str(out), ok, checks, present, a.meta("rank0").get("provenance", {}))


def judge_references(out) -> Verdict:
    """The per-step references alone (03): window, gradref and replay."""
    a = ArtifactSet(Path(out))
    checks = [check_window(a), check_gradref(a), check_replay(a)]
    return Verdict(str(out), all(c.passed for c in checks), checks, ["gradref", "replay"])
