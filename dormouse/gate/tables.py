"""The gate notebooks' tables: parameters, a loss curve, the ranks, gradref per
tensor, the verdict. Each is a `Table`: HTML in a notebook, text elsewhere."""

from __future__ import annotations

import html
from pathlib import Path

from dormouse.gate.artifacts import load_meta
from dormouse.gate.params import Params
from dormouse.gate.produce import locked, rank_names
from dormouse.gate.verdict import compare_ranks


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


def params_table(p: Params, names: list[str] | None = None) -> Table:
    rec = p.record()
    return Table(["parameter", "value"], [[k, rec[k]] for k in (names or rec)], "parameters")


def loss_table(meta: dict, every: int = 5) -> Table:
    losses = meta["losses"]
    rows = [[i + 1, l] for i, l in enumerate(losses) if (i + 1) % every == 0 or i in (0, len(losses) - 1)]
    return Table(["step", "loss"], rows, f"{meta['name']}: global batch {meta.get('global_batch', '?')}")


def ranks_table(d: Path) -> Table:
    """One row per rank: shape, final loss, fingerprint, and whether it is
    bitwise equal to rank0 (dormouse.gate.verdict.compare_ranks)."""
    with locked(d, "fleet"):
        names = rank_names(d)
        metas = [load_meta(d, n) for n in names]
        c = compare_ranks(d)
    per = c.get("per_rank", {})
    rows = []
    for r, (n, m) in enumerate(zip(names, metas)):
        q = per.get(n)
        equal = ("reference" if r == 0 else "?" if q is None else
                 "yes" if not q["unequal_tensors"] and q["losses_equal"]
                 and m["fingerprint"] == metas[0]["fingerprint"] else "NO")
        shape = (m.get("shapes") or ["?"] * len(names))[r]
        rows.append([n, shape, m["losses"][-1] if m["losses"] else None, m["fingerprint"][:16], equal])
    return Table(["rank", "shape", "final loss", "fingerprint", "bitwise = rank0"], rows,
                 f"{d}: {c['reason']}")


def gradref_table(v: dict, top: int | None = None) -> Table:
    """Per tensor: the fleet's one-step parameters against gradref, largest
    difference first. `v`: a verdict (compare's or the pipeline's) or its gradref check."""
    c = v.get("checks", {}).get("gradref", {}) if "checks" in v else v
    per = c.get("per_tensor", {})
    names = sorted(per, key=lambda k: -per[k]["param_rel"])[:top]
    cols = ["param_rel", "step_rel"] + [c_ for c_ in ("grad_rel",) if any(c_ in per[k] for k in names)]
    rows = [[k, *(per[k].get(c_, "") for c_ in cols)] for k in names]
    title = f"gradref [{'ok' if c.get('pass') else 'FAIL'}]: {c.get('reason', 'no gradref check')}"
    if top is not None and len(per) > top:
        title += f" (largest {top} of {len(per)} tensors)"
    return Table(["tensor", *cols], rows, title)


def verdict_table(v: dict) -> Table:
    return Table(["check", "result", "reason"],
                 [[k, "ok" if c.get("pass") else "FAIL", c.get("reason", "")] for k, c in v["checks"].items()],
                 f"gate verdict for {v['out']}: {'PASS' if v['pass'] else 'FAIL'}")
