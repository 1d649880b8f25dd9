"""The gate notebooks' tables: parameters, a loss curve, the ranks, the
per-step references, the verdict. Each is a `Table`: HTML in a notebook, text elsewhere."""

from __future__ import annotations

import html

from dormouse.gate.artifacts import ArtifactSet
from dormouse.gate.judge.facts.ranks import check_ranks_traced, unequal_to_first
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


def loss_table(meta: dict, every: int = 5) -> Table:
    losses = meta["losses"]
    rows = [[i + 1, l] for i, l in enumerate(losses) if (i + 1) % every == 0 or i in (0, len(losses) - 1)]
    return Table(["step", "loss"], rows, f"{meta['name']}: global batch {meta.get('global_batch', '?')}")


def ranks_table(a: ArtifactSet) -> Table:
    """One row per rank of the fleet's artifacts `a` (record.produce.fleet_set
    reads them whole): shape, final loss, fingerprint, and whether it is
    bitwise equal to rank0, as the judge finds (check_ranks_traced, unequal_to_first)."""
    names = a.ranks()
    metas = [a.meta(n) for n in names]
    c = check_ranks_traced(a)
    unequal = unequal_to_first(a, names)
    rows = []
    for r, (n, m) in enumerate(zip(names, metas)):
        shape = (m.get("shapes") or ["?"] * len(names))[r]
        rows.append([n, shape, m["losses"][-1] if m["losses"] else None, m["fingerprint"][:16],
                     "reference" if r == 0 else "yes" if unequal[n] is None else "NO"])
    return Table(["rank", "shape", "final loss", "fingerprint", "bitwise = rank0"], rows, f"{a.out}: {c.reason}")


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
