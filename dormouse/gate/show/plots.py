"""The gate's figures, drawn from a verdict's JSON form (Verdict.to_dict()).

matplotlib is imported inside the functions only, so the core library does not
need it. Figures are built with matplotlib's object API (matplotlib.figure.Figure,
rendered by Agg): no pyplot state, no backend to choose, the same PNGs headless
and in JupyterLab, where `show` displays them inline.

Each function reads only the keys it draws and returns None when its check is
absent, so a verdict that grows more keys (or lacks a check) never breaks them.
"""

from __future__ import annotations

import io
from pathlib import Path

from dormouse import atomic

FLOOR = 1e-12  # where an exact zero difference is drawn on a log axis

FILES = {"loss_curves": "loss_curves.png", "loss_delta": "loss_delta.png",
         "param_divergence": "param_divergence.png", "references": "references.png", "exact": "exact.png",
         "recording_gradient": "recording_gradient.png"}


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _log_y(x) -> float:
    """A value for a log axis: FLOOR for an exact zero, NaN (a gap) for a value
    that is None or not finite (verdict.json writes NaN and inf as null)."""
    import math

    if x is None or not math.isfinite(x):
        return math.nan
    return x if x > 0 else FLOOR


def _mark_nonfinite(ax, steps, values) -> None:
    """A red band at each step whose value is None or not finite (a NaN or inf the line cannot draw)."""
    import math

    bad = [s for s, x in zip(steps, values) if x is None or not math.isfinite(x)]
    for i, s in enumerate(bad):
        ax.axvline(s, color="crimson", alpha=0.3, lw=6, label="NaN or inf" if i == 0 else None)


def _status(check: dict) -> str:
    return "ok" if check.get("pass") else "FAIL"


def losses(curves: dict[str, list], title: str = "loss curve"):
    """Loss curves, one line each: {label: [loss of each step]}."""
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    fig = _figure(6.5, 3.6)
    ax = fig.add_subplot()
    for label, ls in curves.items():
        ax.plot(range(1, len(ls) + 1), ls, "o-", ms=3, label=label)
    ax.set(xlabel="step", ylabel="loss", title=title)
    _integer_steps(ax)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def loss_curves(v: dict, name: str = "curve"):
    """The single process's loss curve and the fleet's, overlaid."""
    c = v.get("checks", {}).get(name)
    if not c or "single" not in c or "fleet" not in c:
        return None
    fig = _figure(6.5, 3.6)
    ax = fig.add_subplot()
    s, f = c["single"], c["fleet"]
    ax.plot(range(1, len(s) + 1), s, "-", lw=2.5, alpha=0.6, label="single (global batch)")
    ax.plot(range(1, len(f) + 1), f, "--o", ms=3, lw=1, label="fleet (rank0)")
    ax.set(xlabel="step", ylabel="loss", title=f"loss curves [{_status(c)}]")
    _integer_steps(ax)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _tolerance(c: dict) -> list[float] | None:
    """The per-step tolerance of a curve check: a list ("tolerance") or one number ("rtol")."""
    n = len(c.get("per_step", []))
    tol = c.get("tolerance", c.get("rtol"))
    if isinstance(tol, (int, float)) and not isinstance(tol, bool):
        return [float(tol)] * n
    if isinstance(tol, list) and len(tol) == n:
        return [float(t) for t in tol]
    return None


def loss_delta(v: dict, name: str = "curve"):
    """|L_fleet - L_single| / |L_single| per step on a log axis, the tolerance
    drawn in (and the measured round-off floor, when the check has one); under
    it, on the same steps, the routing flips (see `_flips_panel`)."""
    c = v.get("checks", {}).get(name)
    if not c or not c.get("per_step"):
        return None
    per = c["per_step"]
    rel = [_log_y(r) for r in per]
    steps = list(range(1, len(rel) + 1))
    fig = _figure(6.5, 5.6)
    ax, flips_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2.2, 1))
    ax.semilogy(steps, rel, "o-", ms=4, label="|ΔL| / |L_single|  (zero drawn at 1e-12)")
    tol = _tolerance(c)
    if tol:
        ax.step(steps, tol, where="mid", color="crimson", ls="--", label="tolerance")
        bad = [k for k, (r, t) in enumerate(zip(per, tol), 1) if r is None or not r <= t]
        if bad:
            ax.semilogy(bad, [rel[k - 1] for k in bad], "x", color="crimson", ms=10, mew=2, label="over tolerance")
    floor = c.get("floor_envelope") or c.get("noise_floor")
    if isinstance(floor, list) and len(floor) == len(per):
        ax.semilogy(steps, [_log_y(f) for f in floor], ":", color="gray", label="measured floor")
    first = c.get("first_flip_step")
    if first:
        ax.axvline(first, color="darkorange", lw=1, ls="-.", label=f"first routing flip (step {first})")
    ax.set(ylabel="relative loss difference", title=f"fleet vs single per step [{_status(c)}]")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    _flips_panel(flips_ax, c, steps)
    flips_ax.set_xlabel("step")
    _integer_steps(flips_ax)
    return fig


def _flips_panel(ax, c: dict, steps: list[int]) -> None:
    """Per step, the tokens whose top-k experts differ between single and
    fleet, stacked by iteration of the shared block; the first flip marked,
    or a line saying why there is nothing to draw."""
    flips, first = c.get("routing_flips"), c.get("first_flip_step")
    ax.set(ylabel="routing flips\n(tokens)")
    ax.grid(alpha=0.3)
    if not flips or not any(map(any, flips)):
        why = ("no expert choices recorded" if "routing_flips" not in c else
               "routing not comparable token by token (ranks of different window lengths)" if flips is None else
               f"no routing flips: every token chose the same experts in single and fleet at all {len(flips)} steps")
        ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", fontsize=8, color="dimgray")
        ax.set_yticks([])
        return
    bottom = [0] * len(flips)
    for i in range(len(flips[0])):
        counts = [row[i] for row in flips]
        ax.bar(steps[:len(counts)], counts, bottom=bottom, width=0.8, label=f"iteration {i + 1}")
        bottom = [b + n for b, n in zip(bottom, counts)]
    if first:
        ax.axvline(first, color="darkorange", lw=1, ls="-.", label=f"first flip: step {first}")
    ax.set_ylim(0, 1.6 * max(bottom))  # room for the legend's one row above the bars
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7, loc="upper left", ncols=len(flips[0]) + 1)


def _barh(ax, names, values, label, color=None):
    ys = range(len(names))
    ax.barh(list(ys), [_log_y(x) for x in values], color=color, label=label)
    ax.set_yticks(list(ys), names, fontsize=7)
    ax.set_xscale("log")
    ax.invert_yaxis()


def references(v: dict):
    """Per step, the worst relative difference of each per-step reference
    check (the per-window premise, gradref) against its bound, on a log axis."""
    checks = v.get("checks", {})
    rows = [(n, c) for n, c in checks.items() if c.get("kind") == "TensorCheck" and c.get("per_step")]
    if not rows:
        return None
    fig = _figure(6.5, 3.6)
    ax = fig.add_subplot()
    for (name, c), color in zip(rows, ("tab:blue", "tab:green", "tab:purple")):
        per = c["per_step"]
        steps = list(range(1, len(per) + 1))
        ax.semilogy(steps, [_log_y(x) for x in per], "o-", ms=3, color=color, label=f"{name} [{_status(c)}]")
        _mark_nonfinite(ax, steps, per)
        if c.get("bound"):
            ax.axhline(c["bound"], color=color, ls="--", lw=1)
    ax.set(xlabel="step", ylabel="max relative difference over tensors",
           title="per-step references (dashed: bounds)")
    _integer_steps(ax)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return fig


def exact(v: dict, name: str = "exact"):
    """The exact check (and the replay) as strips: one cell per step, green
    where every compared tensor and the loss were bitwise equal, red where not."""
    from matplotlib.colors import ListedColormap

    rows = [(n, c) for n, c in v.get("checks", {}).items() if c.get("kind") == "ExactCheck" and c.get("steps_equal")]
    if not rows:
        return None
    fig = _figure(6.5, 0.9 + 0.5 * len(rows))
    ax = fig.add_subplot()
    width = max(len(c["steps_equal"]) for _, c in rows)
    grid = [[1.0 if x else 0.0 for x in c["steps_equal"]] + [float("nan")] * (width - len(c["steps_equal"]))
            for _, c in rows]
    ax.imshow(grid, aspect="auto", cmap=ListedColormap(["crimson", "seagreen"]), vmin=0, vmax=1,
              extent=(0.5, width + 0.5, len(rows) - 0.5, -0.5))
    ax.set_yticks(range(len(rows)), [f"{n} [{_status(c)}]" for n, c in rows], fontsize=8)
    ax.set(xlabel="step", title="bitwise equal per step (green) or not (red)")
    _integer_steps(ax)
    return fig


def param_divergence(v: dict, name: str = "curve"):
    """Per tensor and step, fleet vs single relative difference (when the curve
    check carries its `param_divergence` series); the first tensor to leave its
    own measured floor ringed at that step and named in the title."""
    c = v.get("checks", {}).get(name) or {}
    heat = c.get("param_divergence")
    if not isinstance(heat, dict) or not heat:
        return None
    import numpy as np

    names = sorted(heat, key=lambda k: -max(heat[k] or [0.0]))
    width = max(len(heat[k]) for k in names)
    grid = np.full((len(names), width), np.nan)
    for i, k in enumerate(names):
        grid[i, :len(heat[k])] = np.log10(np.maximum(np.asarray(heat[k], dtype=float), FLOOR))
    fig = _figure(7.5, 1.6 + 0.17 * len(names))
    ax = fig.add_subplot()
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                   extent=(0.5, width + 0.5, len(names) - 0.5, -0.5))
    ax.set_yticks(range(len(names)), names, fontsize=7)
    first, step = c.get("first_divergent_param"), c.get("first_divergent_param_step")
    if first in heat and step:
        row = names.index(first)
        ax.plot([step], [row], "o", ms=11, mfc="none", mec="crimson", mew=2)
        ax.axvline(step, color="crimson", lw=0.8, ls="--")
        ax.get_yticklabels()[row].set_color("crimson")
        said = f"first to leave its floor: {first} at step {step}"
    else:
        said = "no tensor leaves its measured floor"
    ax.set(xlabel="step", title=f"fleet vs single per tensor and step: log10 relative difference\n{said}")
    _integer_steps(ax)
    fig.colorbar(im, ax=ax, label="log10 max|fleet − single| / max|single|")
    return fig


FIGURES = {"loss_curves": loss_curves, "loss_delta": loss_delta, "param_divergence": param_divergence,
           "references": references, "exact": exact}


def recording_gradient(rows: list[dict], title: str = ""):
    """A recording's gradient check per step (judge.facts.gradient.gradient_rows):
    the fleet's gradient against one process's, ||g_fleet - g|| / ||g|| over
    all tensors, against its bound (replay: GRAD_RTOL); sketch / every-k
    recordings hold each tensor to its own bound, so there the tensor nearest
    its bound is drawn with that bound. Steps over their bound are crossed."""
    import math

    from dormouse.gate.judge.bounds import FLOOR_MULTIPLE, RUN_MIN_RTOL

    if not rows:
        return None
    fig = _figure(6.5, 3.6)
    ax = fig.add_subplot()
    steps = [r["step"] for r in rows]
    ax.semilogy(steps, [_log_y(r["error"]) for r in rows], "o-", ms=4, label="fleet vs one process, all tensors")
    _mark_nonfinite(ax, steps, [r["error"] for r in rows])
    if rows[0].get("bound") is not None:
        ax.step(steps, [r["bound"] for r in rows], where="mid", color="crimson", ls="--", label="bound")
    else:
        ax.semilogy(steps, [_log_y(r["tensor_error"]) for r in rows], "s-", ms=3, color="tab:green",
                    label="the tensor nearest its bound")
        ax.step(steps, [r["tensor_bound"] for r in rows], where="mid", color="crimson", ls="--",
                label=f"that tensor's bound ({FLOOR_MULTIPLE:g} x its one-ulp floor, at least {RUN_MIN_RTOL:g})")
    bad = [r for r in rows if not r["ok"]]
    if bad:
        y = [_log_y(r["error"] if r.get("bound") is not None else r["tensor_error"]) for r in bad]
        ax.semilogy([r["step"] for r in bad], y, "x", color="crimson", ms=10, mew=2, label="over its bound")
    ax.set(xlabel="step", ylabel="relative gradient difference",
           title=title or f"gradient per step [{'ok' if not bad else 'FAIL'}]")
    _integer_steps(ax)
    scal = [r.get("scalar") for r in rows]
    if bad and any(c is not None and math.isfinite(c) and abs(c - 1) > 1e-3 for c in scal):
        # the fitted scalar c (g_fleet ~ c g) per step, beside the difference: a wrong count shows as a c per step
        ax2 = ax.twinx()
        ax2.plot(steps, [c if c is not None and math.isfinite(c) else math.nan for c in scal], "d:", ms=4,
                 color="tab:purple", label="fitted scalar c (fleet ≈ c · one process)")
        ax2.set_ylabel("fitted scalar c", color="tab:purple")
        ax2.legend(fontsize=7, loc="lower right")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return fig


def render_recording(v, out: Path | None = None) -> list[Path]:
    """render(v) for a recording's verdict, and the per-step gradient figure
    (recording_gradient) from the recording and its reference in `out`."""
    from dormouse.gate.judge.facts.gradient import gradient_series

    v = v.to_dict() if hasattr(v, "to_dict") else v
    out = Path(out or v["out"])
    paths = render(v, out)
    from dormouse.gate import artifacts as A

    if not A.reference_meta_path(out).exists():  # not judged (past its memory budget, say): no series to draw
        return paths
    fig = recording_gradient(gradient_series(out))
    return paths + (save({"recording_gradient": fig}, out) if fig is not None else [])


def figures(v) -> dict:
    """Every figure the verdict has data for, by name."""
    v = v.to_dict() if hasattr(v, "to_dict") else v
    return {k: fig for k, make in FIGURES.items() if (fig := make(v)) is not None}


def save(figs: dict, out: Path, dpi: int = 110) -> list[Path]:
    """Write each figure as `<out>/<name>.png` (atomically); returns the paths."""
    paths = []
    for k, fig in figs.items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        paths.append(atomic.write_bytes(Path(out) / FILES.get(k, f"{k}.png"), buf.getvalue()))
    return paths


def render(v, out: Path | None = None) -> list[Path]:
    """Draw every figure of verdict `v` (a Verdict or its JSON form) and write
    the PNGs into `out` (the verdict's own out dir by default)."""
    v = v.to_dict() if hasattr(v, "to_dict") else v
    out = Path(out or v["out"])
    figs = figures(v)
    for k, name in FILES.items():  # a figure this verdict has no data for must not linger from an older one
        if k not in figs and k in FIGURES:
            (out / name).unlink(missing_ok=True)
    return save(figs, out)


def show(paths: list[Path]) -> None:
    """Display PNGs inline in a notebook (prints their paths elsewhere)."""
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        for p in paths:
            print(p)
        return
    for p in paths:
        display(Image(filename=str(p)))
