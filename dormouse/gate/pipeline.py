"""The gate notebooks' combined verdict and their papermill runner,
`python -m dormouse.gate.pipeline` (notebooks 01-04 in order).

The notebooks in notebooks/ hold parameters, a call or two into the library,
a table and a plot; every decision lives in dormouse.gate where tests reach
it: parameters (params), producing artifacts (produce), tables (tables),
figures (plots), and here the verdict of curve/ and step/ together.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from dormouse import atomic
from dormouse.errors import DormouseError
from dormouse.gate.artifacts import load_tensors
from dormouse.gate.params import ARTIFACTS, CURVE, DEFAULT_OUT, REPO_ROOT, STEP, Params, ParameterError, check
from dormouse.gate.produce import Log, changed_since_ensured, ensure_all, locked
from dormouse.gate.verdict import compare, format_verdict, relative_difference

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
EXECUTED_DIR = ARTIFACTS / "notebooks"
NOTEBOOKS = ("01_single.ipynb", "02_fleet_launcher.ipynb", "03_gradref.ipynb", "04_compare_plots.ipynb")
VERDICT_FILE = "verdict.json"
# The curve check's keys that say why it judged as it did (see `explain`).
EXPLAINED = ("noise_floor", "tolerance", "per_step", "multiple", "tolerance_why", "routing_flips",
             "first_flip_step", "first_divergent_param", "first_divergent_param_step", "summary")


class GateFailed(DormouseError):
    """The gate ran and found the fleet does not compute the single process's mathematics."""


class NotebookFailed(DormouseError):
    """A pipeline notebook failed for a reason other than the gate's verdict."""


# --------------------------------------------------------------------------- the verdict


def curve_params(d: Path) -> dict | None:
    """Per tensor, max |fleet - single| / max |single| after the curve run
    (informational: the curve check judges the losses)."""
    if not (d / "single.json").exists() or not (d / "rank0.json").exists():
        return None
    single, fleet = load_tensors(d, "single"), load_tensors(d, "rank0")
    return {"per_tensor": {k: relative_difference(fleet[k], single[k]) for k in single if k in fleet},
            "note": "fleet (rank0) vs single after the curve run, max|diff|/max|single| per tensor"}


def compare_step(p: Params) -> dict:
    """03: dormouse.gate.verdict.compare of step/ (gradref vs the one-step fleet, ranks)."""
    with locked(p.step_dir, "gradref", "fleet"):
        return compare(p.step_dir)


def explain(checks: dict) -> dict:
    """Why the curve check judged as it did, in one place: per step the
    measured noise floor, the tolerance and the observed divergence
    (`per_step`), the routing flips, the first tensor to leave its floor, and
    the one-sentence `summary`; with the step check's first divergent tensor."""
    curve = checks.get("curve", {})
    out = {k: curve.get(k) for k in EXPLAINED}
    if out["summary"] is None:
        out["summary"] = curve.get("reason") or ("no loss-curve check (the capacity profile mixes window "
                                                 "lengths, so no single process holds the global batch): "
                                                 "gradref is the reference")
    if "first_divergent_param" in checks.get("gradref", {}):
        out["step_first_divergent_param"] = checks["gradref"]["first_divergent_param"]
    return out


def verdict(p: Params) -> dict:
    """Compare curve/ and step/ (each under its locks) into one verdict.

    `parts` holds dormouse.gate.verdict.compare() of each directory whole;
    `checks` merges their checks (the step run's checks that share a name with
    the curve run's get a `step_` prefix: `step_ranks`); `explain` gathers
    the curve check's explanation at the top level."""
    with locked(p.curve_dir, "single", "fleet"), locked(p.step_dir, "gradref", "fleet"):
        # Judge exactly the artifacts `p` asked for: another notebook may have
        # replaced them between ensure_all and now.
        changed = changed_since_ensured(p)
        if changed:
            raise DormouseError(f"the artifacts changed while the verdict was being taken ({changed}): "
                                "run 04 again (or give each concurrent run its own out)")
        parts = {CURVE: compare(p.curve_dir), STEP: compare(p.step_dir)}
        curve = curve_params(p.curve_dir)
    checks = dict(parts[CURVE]["checks"])
    for k, c in parts[STEP]["checks"].items():
        checks[f"step_{k}" if k in checks else k] = c
    v = {"pass": all(part["pass"] for part in parts.values()), "out": str(p.out), "explain": explain(checks),
         "checks": checks, "reasons": [f"{k}: {c.get('reason', '')}" for k, c in checks.items()],
         "parts": {k: {"pass": v_["pass"], "out": v_["out"], "checks": list(v_["checks"])} for k, v_ in parts.items()},
         "params": p.record()}
    if curve is not None:
        v["curve_params"] = curve
    return v


def write_verdict(v: dict, out: Path) -> Path:
    return atomic.write_text(Path(out) / VERDICT_FILE, json.dumps(v, indent=1, default=str))


def gate(p: Params, *, log: Log = print) -> dict:
    """04: ensure the artifacts, compare, write verdict.json; returns the verdict."""
    ensure_all(p, log=log)
    v = verdict(p)
    write_verdict(v, p.out)
    return v


def raise_if_failed(v: dict) -> None:
    """Raise GateFailed (so papermill and nbmake fail) unless the gate passed."""
    if not v["pass"]:
        raise GateFailed(format_verdict(v))


# --------------------------------------------------------------------------- the papermill runner


def parse_value(text: str):
    """papermill's -p conversion: int, float, True/False/None, else the string."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def notebook_parameters(path: Path) -> list[str]:
    """The names a notebook's `parameters` cell assigns."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            return re.findall(r"^([A-Za-z_]\w*)\s*(?::[^=]*)?=", cell.source, re.M)
    return []


def run_pipeline(overrides: dict, *, executed: Path | None = None, notebooks=NOTEBOOKS,
                 log: Log = print, log_output: bool = True) -> dict | None:
    """Run the notebooks in order under papermill (the kernel in the caller's
    working directory); returns the verdict (None when 04 was not among
    them). Each override goes only to the
    notebooks whose parameters cell names it; 01 is given the global batch of
    the fleet the others describe. Raises ParameterError before running
    anything when an override is bad, GateFailed when the gate fails."""
    p = check(**overrides)  # before anything runs (or papermill is imported)
    if not NOTEBOOK_DIR.is_dir():
        raise DormouseError(f"no notebooks at {NOTEBOOK_DIR}: the pipeline runs from a checkout of the "
                            "repository installed with `pip install -e .` (a plain install has no notebooks)")
    import papermill as pm

    # The validated values (capacity normalised, out absolute); a world given
    # without a profile runs the batch on every rank, in every notebook.
    given = {k: getattr(p, k) for k in overrides}
    if "world" in overrides and "capacity" not in overrides:
        given["capacity"] = p.capacity
    if "out" in given:
        given["out"] = str(p.out)
    if executed is None:
        executed = EXECUTED_DIR if p.out == DEFAULT_OUT else p.out / "notebooks"
    executed = Path(executed)
    executed.mkdir(parents=True, exist_ok=True)
    for name in notebooks:
        src = NOTEBOOK_DIR / name
        declared = notebook_parameters(src)
        params = {k: v for k, v in given.items() if k in declared}
        if name.startswith("01"):
            gb = p.global_batch()
            if gb is None:
                log(f"== {name}: skipped (capacity {p.capacity!r} mixes window lengths: no single-process curve)")
                continue
            params["batch"] = gb
        log(f"== {name} {' '.join(f'-p {k} {v}' for k, v in params.items())}".rstrip())
        try:
            pm.execute_notebook(str(src), str(executed / name), parameters=params, kernel_name="python3",
                                progress_bar=False, log_output=log_output)
        except pm.PapermillExecutionError as e:
            if e.ename == GateFailed.__name__:
                v = json.loads((p.out / VERDICT_FILE).read_text())
                raise GateFailed(format_verdict(v)) from None
            raise NotebookFailed(f"{name} failed ({e.ename}: {e.evalue}); executed copy: "
                                 f"{executed / name}") from None
    if not any(n.startswith("04") for n in notebooks):
        return None  # no verdict without 04
    return json.loads((p.out / VERDICT_FILE).read_text())


def _cli() -> argparse.ArgumentParser:
    a = argparse.ArgumentParser(
        prog="python -m dormouse.gate.pipeline",
        description="Run notebooks 01-04 under papermill; executed copies, figures and verdict.json "
                    "go to artifacts/. Exit 0 when the gate passes, 1 when it fails, 2 on bad input.")
    a.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="a notebook parameter (papermill's conversion), e.g. -p world 3 -p capacity 4,2,1")
    a.add_argument("-r", "--raw", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="a parameter kept as a string")
    a.add_argument("--executed", default=None,
                   help="where executed notebooks go (default artifacts/notebooks, or <out>/notebooks)")
    a.add_argument("--only", default="",
                   help="run only these notebooks, by number: e.g. 04 (re-judge artifacts already there)")
    a.add_argument("--quiet", action="store_true", help="do not echo the notebooks' output")
    return a


def main(argv: list[str] | None = None) -> int:
    args = _cli().parse_args(argv)
    overrides = {k: parse_value(v) for k, v in args.parameter}
    overrides.update({k: v for k, v in args.raw})
    if not args.quiet:
        import logging

        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        # papermill logs each cell's output at INFO, between its own markers
        handler.addFilter(lambda r: not re.match(r"(Executing|Ending) Cell \d+-+$", r.getMessage()))
        log = logging.getLogger("papermill")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    chosen = tuple(n for n in NOTEBOOKS if not only or n[:2] in only)
    if not chosen or (only and len(set(only)) != len(chosen)):
        print(f"error: --only {args.only!r}: name notebooks by number, among "
              f"{', '.join(n[:2] for n in NOTEBOOKS)}", file=sys.stderr)
        return 2
    try:
        v = run_pipeline(overrides, executed=args.executed and Path(args.executed), notebooks=chosen,
                         log_output=not args.quiet)
    except ParameterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GateFailed as e:
        print(e)
        return 1
    except DormouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the running notebook's kernel (and any fleet it launched) was stopped",
              file=sys.stderr)
        return 130
    if v is None:
        print(f"ran {', '.join(chosen)}; no verdict without 04")
        return 0
    print(format_verdict(v))
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
