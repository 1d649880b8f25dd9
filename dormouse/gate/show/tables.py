"""The gate notebooks' tables: parameters, a loss curve, the ranks, the
per-step references, the verdict. Each is a `Table`: HTML in a notebook, text elsewhere."""

from __future__ import annotations

import html

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import RecordingSet
from dormouse.gate.judge.facts.ranks import check_ranks
from dormouse.gate.judge.verdict import Verdict


class Table:
    """A small table that renders as HTML in a notebook and as text elsewhere."""

    def __init__(self, columns: list[str], rows: list[list], title: str = ""):
        self.columns, self.rows, self.title = list(columns), [list(r) for r in rows], title

    @staticmethod
    def _cell(x) -> str:
        if isinstance(x, float):
            return f"{x:.3e}" if x and (abs(x) < 1e-3 or abs(x) >= 1e5) else f"{x:.7g}"
        return str(x)

    def __str__(self) -> str:
        cells = [self.columns] + [[self._cell(x) for x in r] for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(([self.title] if self.title else []) + lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(self._cell(x))}</td>" for x in r) + "</tr>"
                       for r in self.rows)
        cap = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def params_table(s, names: list[str] | None = None) -> Table:
    """The settings `s` (a GateSettings) as the artifacts record them, with out, timeout_s and produce."""
    rec = {"out": str(s.out_dir), **s.record(), "timeout_s": s.timeout_s, "produce": s.produce}
    return Table(["parameter", "value"], [[k, rec[k]] for k in (names or rec)], "parameters")


def loss_table(rec: RecordingSet, title: str, every: int = 5) -> Table:
    """A recording's logged loss, every `every` steps, its first and its last."""
    losses = rec.losses()
    rows = [[k, l] for i, (k, l) in enumerate(zip(rec.steps, losses))
            if k % every == 0 or i in (0, len(losses) - 1)]
    return Table(["step", "loss"], rows, title)


def ranks_table(rec: RecordingSet) -> Table:
    """One row per rank of the fleet's recording (record.produce.fleet_recording
    reads it whole): its windows of the last step, its logged loss there, the
    hash of its parameters after the last step, and whether it equals rank 0's,
    with the judge's ranks check as the title."""
    last = rec.steps[-1]
    world = rec.world_at(last)
    hashes = [A.read_json(A.final_meta_path(rec.out, r), "final").get("param_hash") for r in range(world)]
    rows = []
    for r in range(world):
        m = rec.step_meta(r, last)
        windows = sum(int(b["arg0"].shape[0]) for rr, _, b in rec.micro_batches(last) if rr == r and "arg0" in b)
        rows.append([A.rank_name(r), windows, m.get("loss"), (hashes[r] or "?")[:16],
                     "reference" if r == 0 else "yes" if hashes[r] == hashes[0] else "NO"])
    return Table(["rank", "windows", "final loss", "parameter hash", "= rank0"], rows,
                 f"{rec.out}: {check_ranks(rec).reason}")


def references_table(v: Verdict | dict) -> Table:
    """The per-step checks (window, gradref, replay, exact, curve): worst
    difference, where, and the bound."""
    d = v.to_dict() if isinstance(v, Verdict) else v
    rows = []
    for name, c in d["checks"].items():
        if c.get("kind") == "TensorCheck":
            rows.append([name, "ok" if c["pass"] else "FAIL", c.get("worst"), c.get("worst_tensor"),
                         c.get("worst_step"), c.get("bound")])
        elif c.get("kind") == "ExactCheck":
            eq = c.get("steps_equal", [])
            rows.append([name, "ok" if c["pass"] else "FAIL", 0.0 if c["pass"] else c.get("ulps"),
                         c.get("first_tensor") or f"{sum(eq)}/{len(eq)} steps bitwise", c.get("first_step"), 0.0])
        elif c.get("kind") == "CurveCheck":
            rows.append([name, "ok" if c["pass"] else "FAIL", max(c.get("per_step") or [0.0]),
                         c.get("first_divergent_param") or "loss", c.get("first_divergent_param_step"),
                         min(c.get("tolerance") or [0.0])])
    return Table(["check", "result", "worst (relative; ulps for bitwise)", "where", "step", "bound"], rows,
                 "per-step references")


def verdict_table(v: Verdict | dict) -> Table:
    d = v.to_dict() if isinstance(v, Verdict) else v
    return Table(["check", "result", "reason"],
                 [[k, "ok" if c["pass"] else "FAIL", c["reason"]] for k, c in d["checks"].items()],
                 f"gate verdict for {d['out']}: {'PASS' if d['pass'] else 'FAIL'}")


def recording_gradient_table(rows: list[dict]) -> Table:
    """A recording's gradient check per step (judge.facts.gradient.gradient_rows):
    the error over all tensors, the tensor nearest its bound and that bound
    (replay: the tensor that differs most; the bound is on all tensors together)."""
    return Table(["step", "all tensors", "tensor", "its difference", "its bound", "result"],
                 [[r["step"], r["error"], r["tensor"], r["tensor_error"],
                   r["tensor_bound"] if r["tensor_bound"] is not None else f"(all: {r['bound']:g})",
                   "ok" if r["ok"] else "FAIL"] for r in rows], "gradient per step: fleet vs one process")
