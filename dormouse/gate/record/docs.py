"""docs/recording.md, the reference page of the recording's options, generated from the code:
every field of RecordingSpec with its default and its meaning (the fields' `doc`), what
recording.json records beside them (RecordedRun's fields), every keyword of the Recorder and of
the two framework callbacks with its default (their signatures, read by `inspect`) and its
meaning (their docstrings' option tables), and the Recorder's calls with their docstrings.

    python -m dormouse.gate.record.docs > docs/recording.md

A keyword the signature has and the docstring does not describe is an error (the page would
miss it): describe it in the class docstring, then regenerate. tests/test_docs.py checks that
the page is this module's output.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from dormouse.errors import DormouseError

COMMAND = "python -m dormouse.gate.record.docs > docs/recording.md"
_ROW = re.compile(r"^([A-Za-z_]\w*(?:, [A-Za-z_]\w*)*):?\s+(\S.*)$")


def options_table(doc: str, names: set[str]) -> dict[str, str]:
    """{option: meaning} from a docstring's table: an option's line at the docstring's own indent
    (one or more of `names`, comma-separated, then its meaning), its continuation lines indented
    further."""
    table: dict[str, str] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(doc).splitlines():
        m = _ROW.match(line)
        if m and set(m.group(1).split(", ")) <= names:
            current = [m.group(2).strip()]
            for name in m.group(1).split(", "):
                table[name] = current  # type: ignore[assignment]
        elif current is not None and line.startswith(" ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return {name: " ".join(parts) for name, parts in table.items()}


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def read_class(module: str, name: str) -> tuple[str, list[tuple[str, str]]]:
    """(docstring, [(keyword, its default as the page shows it)]) of class `name`'s __init__ in
    dormouse module `module`, read from its source (the callbacks' modules import their frameworks:
    the page is written without them). A default that names a constant is shown as its value."""
    from dormouse.gate.record import options

    path = Path(__file__).resolve().parents[2] / (module.replace(".", "/").removeprefix("dormouse/") + ".py")
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    a = init.args

    def shown(node) -> str:
        if node is None:
            return "required"
        if isinstance(node, ast.Name) and hasattr(options, node.id):
            return f"`{getattr(options, node.id)!r}`"
        return f"`{ast.unparse(node)}`"

    positional = [x.arg for x in a.args][1:]
    pdefaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = list(zip(positional, map(shown, pdefaults)))
    params += [(x.arg, shown(d)) for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    return ast.get_docstring(cls, clean=False) or "", params


def described(doc: str, names: list[str], where: str) -> dict[str, str]:
    """The docstring's meaning of every keyword in `names`; one missing is an error naming it."""
    meanings = options_table(doc, set(names))
    missing = [p for p in names if p not in meanings]
    if missing:
        raise DormouseError(f"{where}'s docstring does not describe {', '.join(missing)}: add a line for "
                            f"each to its option table, then run {COMMAND}")
    return meanings


def class_section(title: str, module: str, name: str, intro: str) -> list[str]:
    """A class's keywords as a table: option, default, meaning; every keyword described."""
    doc, params = read_class(module, name)
    meanings = described(doc, [p for p, _ in params], f"{module}.{name}")
    out = [f"## {title}", "", intro, "", "| option | default | meaning |", "|---|---|---|"]
    for p, default in params:
        out.append(f"| `{p}` | {_cell(default)} | {_cell(meanings[p])} |")
    return out + [""]


def _call(sig: inspect.Signature) -> str:
    """A signature as a call shows it: names and defaults, no annotations, no self."""
    out, star = [], False
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return f"({', '.join(out)})"


def method_section(cls, names: tuple[str, ...]) -> list[str]:
    out = ["## The Recorder's calls", ""]
    for name in names:
        fn = getattr(cls, name)
        sig = _call(inspect.signature(fn))
        doc = " ".join(inspect.getdoc(fn).split())
        out += [f"`rec.{name}{sig}`", "", doc, ""]
    return out


def spec_section() -> list[str]:
    """RecordingSpec's fields as a table: field, default, meaning (artifacts/spec.py)."""
    from dormouse.gate.artifacts.spec import spec_docs

    out = ["## `RecordingSpec`: what to record", "",
           "`from dormouse.gate import RecordingSpec`; `RecordingSpec(build_model=..., build_optimizer=..., ...)`: "
           "frozen, checked when it is made (one line naming the field), written into recording.json as it is "
           "and read back from it. The Recorder and both callbacks take one.", "",
           "| field | default | meaning |", "|---|---|---|"]
    out += [f"| `{name}` | {_cell(default)} | {_cell(doc)} |" for name, default, doc in spec_docs()]
    return out + [""]


def recorded_section() -> list[str]:
    """RecordedRun's fields: what recording.json says about the run beside the spec."""
    from dormouse.gate.artifacts.layout import RECORDING_SCHEMA
    from dormouse.gate.artifacts.spec import recorded_docs

    out = ["## What recording.json records beside the spec", "",
           f"`RecordedRun` (schema {RECORDING_SCHEMA}; a recording of an older schema is refused in one line: "
           "re-record it). A reader's `RecordingSet(out).spec` and `.recorded` are the two.", "",
           "| field | meaning |", "|---|---|"]
    out += [f"| `{name}` | {_cell(doc)} |" for name, doc in recorded_docs()]
    return out + [""]


def page() -> str:
    from dormouse.gate.record.recorder import Recorder

    lines = [
        "# Recording: every option",
        "",
        f"Generated by `{COMMAND}` from `dormouse.gate.artifacts.spec` (the fields and their docs) and the",
        "signatures and docstrings of `dormouse.gate.record.recorder.Recorder`,",
        "`dormouse.gate.record.hf.TrainerRecorder` and `dormouse.gate.record.lightning.LightningRecorder`:",
        "edit those, not this page. The guide: [your-loop.md](your-loop.md); the limits: [limits.md](limits.md).",
        "",
    ]
    lines += spec_section()
    lines += class_section("`Recorder` (plain DDP, FSDP2, `accelerate` and parallel loops)",
                           "dormouse.gate.record.recorder", "Recorder",
                           "`from dormouse.gate import Recorder, RecordingSpec`; `Recorder(out_dir, model, "
                           "RecordingSpec(build_model=..., build_optimizer=..., ...))`; the keywords are the run's "
                           "layout, not the spec. Guide: [clients/plain.md](clients/plain.md).")
    lines += method_section(Recorder, ("step", "labels", "beside", "report", "close"))
    lines += class_section("HF `TrainerRecorder` (transformers' `Trainer`, TRL, PEFT)",
                           "dormouse.gate.record.hf", "TrainerRecorder",
                           "`from dormouse.gate.record.hf import TrainerRecorder`; "
                           "`TrainerRecorder(out_dir, spec)`. Guide: [clients/hf.md](clients/hf.md).")
    lines += class_section("Lightning `LightningRecorder`", "dormouse.gate.record.lightning", "LightningRecorder",
                           "`from dormouse.gate.record.lightning import LightningRecorder`; "
                           "`LightningRecorder(out_dir, spec, module=...)`. Guide: "
                           "[clients/lightning.md](clients/lightning.md).")
    lines += recorded_section()
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    import sys

    try:
        text = page()
    except DormouseError as e:
        print(f"dormouse.gate.record.docs: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(text, end="")


if __name__ == "__main__":
    main()
