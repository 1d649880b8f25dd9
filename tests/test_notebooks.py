"""The notebook pipeline: clean notebooks, real papermill and nbmake runs from
the repository root and from elsewhere, the verdict notebook failing on planted
faults and passing on clean artifacts, one-sentence errors for bad parameters.

No mocks: every notebook run starts a real kernel and (where the notebook does)
a real torchrun fleet, at the notebooks' CI-sized defaults. Runs use a tmp
`out` (tests stay independent) except the default-location tests.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import papermill as pm
import pytest

from dormouse import atomic
from dormouse.errors import DormouseError, FleetError
from dormouse.gate import params, pipeline, plots, produce
from dormouse.gate.artifacts import load_meta, load_tensors, save_artifact

NB = pipeline.NOTEBOOK_DIR
REPO = params.REPO_ROOT
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_nb(name: str, out_nb: Path, *, cwd: Path, **params) -> nbformat.NotebookNode:
    """papermill with the kernel in `cwd` (as `cd cwd && papermill ...` does)."""
    return pm.execute_notebook(str(NB / name), str(out_nb), parameters=params, cwd=str(cwd),
                               kernel_name="python3", progress_bar=False)


def failing(name: str, out_nb: Path, *, cwd: Path, **params) -> pm.PapermillExecutionError:
    with pytest.raises(pm.PapermillExecutionError) as info:
        run_nb(name, out_nb, cwd=cwd, **params)
    return info.value


def error_cell(path: Path) -> tuple[int, nbformat.NotebookNode]:
    nb = nbformat.read(str(path), as_version=4)
    for i, cell in enumerate(nb.cells):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return i, cell
    raise AssertionError("no cell failed")


def all_text(path: Path) -> str:
    nb = nbformat.read(str(path), as_version=4)
    chunks = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            chunks.append(o.get("text", "") or "")
            chunks.append(str(o.get("data", {}).get("text/plain", "")))
    return "\n".join(chunks)


# --------------------------------------------------------------------------- clean notebooks


@pytest.mark.parametrize("name", pipeline.NOTEBOOKS)
def test_notebook_is_clean(name):
    nb = nbformat.read(str(NB / name), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    for c in code:
        assert c.outputs == [], f"{name}: a cell has outputs"
        assert c.execution_count is None, f"{name}: a cell has an execution count"
    assert nb.cells[0].cell_type == "markdown" and "papermill" in nb.cells[0].source
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert tagged == [1], f"{name}: exactly one `parameters` cell, right after the markdown"
    # papermill parses every parameter (a comment holding '=' would hide it)
    assert list(pm.inspect_notebook(str(NB / name))) == pipeline.notebook_parameters(NB / name)


def defaults(name: str) -> dict:
    return {k: ast.literal_eval(v["default"]) for k, v in pm.inspect_notebook(str(NB / name)).items()}


def test_notebook_defaults_agree_with_the_library():
    """CI-sized, valid, and one configuration: 01's global batch is the fleet's."""
    d = params.DEFAULTS
    for name in pipeline.NOTEBOOKS:
        given = defaults(name)
        assert given["out"] is None
        p = params.check(**given)
        for k in given:
            if k not in ("out", "batch") or not name.startswith("01"):
                assert getattr(p, k) == getattr(d, k), (name, k)
        assert p.steps <= 20
    assert defaults("01_single.ipynb")["batch"] == d.global_batch()


# --------------------------------------------------------------------------- the library, without kernels


def test_default_out_is_the_repository_not_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert params.check().out == REPO / "artifacts" / "gate"
    assert params.check(out="x/y").out == REPO / "x" / "y"
    assert params.check(out=str(tmp_path / "o")).out == tmp_path / "o"
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("given, name, allowed", [
    ({"world": 0}, "world", "1 or more"),
    ({"world": -3}, "world", "1 or more"),
    ({"world": "two"}, "world", "1 or more"),
    ({"world": 2.0}, "world", "whole number"),
    ({"world": 2, "capacity": "4,2,1"}, "capacity", "one comma-separated entry per rank"),
    ({"world": 3}, None, None),  # another world without a profile: the batch on every rank
    ({"capacity": "4,x"}, "capacity", "'B' or 'BxT'"),
    ({"capacity": "4x65,2"}, "capacity", "at most 64"),
    ({"steps": 0}, "steps", "1 or more"),
    ({"batch": 0}, "batch", "1 or more"),
    ({"lr": 0}, "lr", "positive"),
    ({"opt": "sgd"}, "opt", "'mix', 'adamw'"),
    ({"shard": "zero3"}, "shard", "'none', 'fsdp'"),
    ({"reduce": "fp16"}, "reduce", "'fp32', 'bf16'"),
    ({"timeout_s": -1}, "timeout_s", "positive"),
    ({"produce": "yes"}, "produce", "True"),
    ({"bogus": 1}, "bogus", "use out, steps"),
])
def test_bad_parameters_raise_one_sentence(given, name, allowed):
    if name is None:
        assert params.check(**given).capacity == ""
        return
    with pytest.raises(params.ParameterError) as info:
        params.check(**given)
    msg = str(info.value)
    assert isinstance(info.value, DormouseError)
    assert name in msg and allowed in msg
    assert "\n" not in msg and msg.endswith("."), msg
    assert info.value._render_traceback_() == [f"ParameterError: {msg}"]


def test_cuda_without_a_gpu_is_a_parameter_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(params.ParameterError, match=r"^device = 'cuda' is not allowed here: .* must be 'cpu'\.$"):
        params.check(device="cuda")


def test_unwritable_out_is_a_parameter_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(params.ParameterError, match=r"^out = .* cannot be written .*writable directory"):
        params.check(out=str(tmp_path / "file" / "sub"))


def test_capacity_from_papermill_int_and_spaces():
    assert params.check(world=1, capacity=4).capacity == "4"
    assert params.check(capacity=" 4, 2 ").capacity == "4,2"
    assert params.check(world=2, capacity="4x32,2").global_batch() is None
    assert params.check(world=3, batch=2).global_batch() == 6


def test_every_dormouse_error_renders_as_its_message_in_a_notebook():
    assert FleetError("the fleet failed")._render_traceback_() == ["FleetError: the fleet failed"]
    assert produce.MissingArtifactError("m")._render_traceback_() == ["MissingArtifactError: m"]


def _curve_verdict(flips, first_flip, param=None, param_step=None) -> dict:
    per = [1e-8] * 4
    return {"checks": {"curve": {
        "pass": True, "per_step": per, "tolerance": [1e-6] * 4, "floor_envelope": per, "routing_flips": flips,
        "first_flip_step": first_flip, "param_divergence": {"a": [1e-8] * 4, "b": [1e-7] * 4},
        "first_divergent_param": param, "first_divergent_param_step": param_step}}}


def _text(fig) -> str:
    """Every text a figure shows: in its axes and their titles."""
    return "\n".join([t.get_text() for ax in fig.axes for t in ax.texts] + [ax.get_title() for ax in fig.axes])


def test_loss_delta_draws_routing_flips_under_the_loss_difference():
    fig = plots.loss_delta(_curve_verdict([[0, 0], [0, 2], [1, 1], [0, 0]], 2))
    top, flips = fig.axes
    assert flips.get_shared_x_axes().joined(top, flips)
    assert len(flips.patches) == 8  # one bar per step and iteration, stacked
    assert any("first flip: step 2" in t.get_text() for t in flips.get_legend().get_texts())
    quiet = plots.loss_delta(_curve_verdict([[0, 0]] * 4, None))
    assert "no routing flips: every token chose the same experts" in _text(quiet)


def test_param_divergence_names_and_marks_the_first_divergent_tensor():
    assert "first to leave its floor: b at step 3" in _text(plots.param_divergence(_curve_verdict([], None, "b", 3)))
    assert "no tensor leaves its measured floor" in _text(plots.param_divergence(_curve_verdict([], None)))


def test_lock_serialises_and_force_reuses_what_was_made_while_waiting(tmp_path):
    """Two producers of one artifact set: the second waits on the flock and,
    when the set was written while it waited, does not make it again."""
    p = params.check(out=str(tmp_path))
    made = []

    def make(tag):
        def _make():
            made.append(tag)
            time.sleep(0.3)
            atomic.write_text(tmp_path / "a.json", json.dumps({"schema": 1, "settings": {"k": 1}}))
        return _make

    def status():
        return produce._differs(produce._meta(tmp_path, "a"), {"k": 1})

    results = []

    def producer(tag, force):
        results.append(produce._ensure(tmp_path, "a", "test", status, lambda: ["a"], make(tag),
                                       p=p, force=force, log=lambda _: None, hint="-")[0])

    threads = [threading.Thread(target=producer, args=("first", False))]
    threads[0].start()
    time.sleep(0.1)
    threads.append(threading.Thread(target=producer, args=("second", True)))
    threads[1].start()
    for t in threads:
        t.join()
    assert made == ["first"] and sorted(results) == ["produced", "reused"]
    # Forced later (nobody else writing): it is made again.
    producer("third", True)
    assert made == ["first", "third"]
    # Made with other settings and produce=False: refused in one sentence naming `produce`.
    atomic.write_text(tmp_path / "a.json", json.dumps({"settings": {"k": 2}}))
    with pytest.raises(produce.MissingArtifactError, match=r"made with k=2 .*produce = False.*produce = True\.$"):
        produce._ensure(tmp_path, "a", "test", status, lambda: ["a"], make("x"),
                        p=params.check(out=str(tmp_path), produce=False), force=False,
                        log=lambda _: None, hint="01")


def test_pipeline_cli_bad_input_exits_2_with_one_line(tmp_path):
    for args in (["-p", "world", "0"], ["-p", "world", "two"], ["-p", "bogus", "1"],
                 ["-p", "world", "2", "-p", "capacity", "4,2,1"]):
        r = subprocess.run([sys.executable, "-m", "dormouse.gate.pipeline", "-p", "out", str(tmp_path), *args],
                           cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=120)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: "), r.stderr
    assert not (tmp_path / "notebooks").exists()  # nothing ran


# --------------------------------------------------------------------------- notebooks under papermill


@pytest.fixture(scope="session")
def gate_run(tmp_path_factory):
    """The whole pipeline from a directory that is not the repository:
    `cd elsewhere && python -m dormouse.gate.pipeline -p out <tmp>`. Run once
    per session even under xdist: the workers share it through a flock."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's directory, shared by its workers
    base = root / "notebook-pipeline"
    cwd, out, result = base / "elsewhere", base / "out", base / "result.json"
    with produce.locked(base, "fixture"):
        if not result.exists():
            cwd.mkdir(parents=True)
            r = subprocess.run([sys.executable, "-m", "dormouse.gate.pipeline", "--quiet", "-p", "out", str(out)],
                               cwd=cwd, capture_output=True, text=True, env=ENV, timeout=500)
            atomic.write_text(result, json.dumps({"returncode": r.returncode, "stdout": r.stdout,
                                                  "stderr": r.stderr}))
    r = subprocess.CompletedProcess([], **json.loads(result.read_text()))
    if r.returncode != 0:
        pytest.fail(f"the pipeline failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r, cwd, out


def test_pipeline_runs_all_four_in_order_from_elsewhere(gate_run):
    r, cwd, out = gate_run
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gate verdict" in r.stdout and "PASS" in r.stdout
    assert list(cwd.iterdir()) == []  # nothing written in the working directory
    assert not list((out / "curve").glob("rank2*"))
    assert sorted(p.name for p in (out / "notebooks").iterdir()) == sorted(pipeline.NOTEBOOKS)
    v = json.loads((out / "verdict.json").read_text())
    assert v["pass"] and {"ranks", "curve", "gradref", "step_ranks"} <= set(v["checks"])
    explain = v["explain"]  # the curve check's explanation, at the top level
    assert set(pipeline.EXPLAINED) | {"step_first_divergent_param"} == set(explain)
    assert all(explain[k] == v["checks"]["curve"][k] for k in pipeline.EXPLAINED)
    assert len(explain["noise_floor"]) == len(explain["tolerance"]) == len(explain["per_step"]) == 20
    assert explain["summary"] in all_text(out / "notebooks" / "04_compare_plots.ipynb")
    # artifacts record what made them: the fleet's real world, gradref's one step
    assert load_meta(out / "curve", "rank1")["settings"]["world"] == 2
    assert all(load_meta(out / "step", n)["settings"]["steps"] == 1 for n in ("gradref", "init", "gradref_grad"))
    for png in ("loss_curves.png", "loss_delta.png", "curve_params.png", "gradref.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "curve" / "single.json").exists() and (out / "step" / "gradref.json").exists()
    # 04 found everything 01-03 made and produced nothing itself
    text = all_text(out / "notebooks" / "04_compare_plots.ipynb")
    assert "producing" not in text and text.count(": using ") == 4, text


def test_fleet_notebook_alone_from_the_repository_root(tmp_path):
    out = tmp_path / "out"
    run_nb("02_fleet_launcher.ipynb", tmp_path / "02.ipynb", cwd=REPO, out=str(out), world=3, capacity="2,1,1",
           steps=3)
    assert [load_meta(out / "curve", f"rank{r}")["world_size"] for r in range(3)] == [3, 3, 3]
    assert [load_meta(out / "curve", f"rank{r}")["settings"]["world"] for r in range(3)] == [3, 3, 3]
    text = all_text(tmp_path / "02.ipynb")
    assert "[rank2] step=3/3" in text  # rank output streamed into the cell
    assert "all 3 ranks bitwise equal" in text
    assert sum(line.rstrip().endswith(" yes") for line in text.splitlines()) == 2  # the table agrees


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            found.append(cmd)
    return found


def test_fleet_notebook_timeout_kills_every_rank_in_one_sentence(tmp_path):
    out = tmp_path / "out"
    e = failing("02_fleet_launcher.ipynb", tmp_path / "02.ipynb", cwd=tmp_path, out=str(out), steps=100000,
                timeout_s=3)
    assert e.ename == "FleetError" and "did not finish within 3 s and was killed" in e.evalue
    assert e.traceback == [f"FleetError: {e.evalue}"]
    assert _processes_mentioning(str(out)) == []
    assert not list((out / "curve").glob("rank*.json"))


def test_gradref_notebook_alone_from_elsewhere(tmp_path):
    out = tmp_path / "out"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run_nb("03_gradref.ipynb", tmp_path / "03.ipynb", cwd=cwd, out=str(out))
    assert {"gradref.json", "init.json", "rank0.json", "rank1.json"} <= {p.name for p in (out / "step").iterdir()}
    assert "param_rel" in all_text(tmp_path / "03.ipynb")
    assert list(cwd.iterdir()) == []


def test_verdict_notebook_alone_produces_what_is_missing(tmp_path):
    """04 first, on an empty out, from the repository root: it produces every
    artifact set through the library, then passes."""
    out = tmp_path / "out"
    run_nb("04_compare_plots.ipynb", tmp_path / "04.ipynb", cwd=REPO, out=str(out), steps=4)
    v = json.loads((out / "verdict.json").read_text())
    assert v["pass"], v["reasons"]
    text = all_text(tmp_path / "04.ipynb")
    assert text.count("producing") == 4


def test_verdict_notebook_replaces_an_artifact_from_another_configuration(gate_run, tmp_path):
    """Other steps: the curve's artifacts are made again, the one-step ones kept."""
    _, _, clean = gate_run
    out = tmp_path / "out"
    shutil.copytree(clean, out, ignore=shutil.ignore_patterns("notebooks", "ckpts", "*.lock"))
    kept = (out / "step" / "gradref.json").stat().st_mtime_ns
    run_nb("04_compare_plots.ipynb", tmp_path / "04.ipynb", cwd=tmp_path, out=str(out), steps=6)
    text = all_text(tmp_path / "04.ipynb")
    assert "single-process: producing" in text and "made with steps=20 (want 6)" in text
    assert "gradref: using" in text and (out / "step" / "gradref.json").stat().st_mtime_ns == kept
    assert load_meta(out / "curve", "rank1")["settings"]["steps"] == 6
    assert json.loads((out / "verdict.json").read_text())["pass"]


def test_single_notebook_writes_the_default_location_from_any_cwd(tmp_path):
    """papermill from the repository root and from elsewhere, and nbmake (which
    runs in notebooks/): all three write <repo>/artifacts/gate, never the cwd."""
    single = REPO / "artifacts" / "gate" / "curve" / "single.json"
    stamps = []
    for cwd in (REPO, tmp_path):
        run_nb("01_single.ipynb", tmp_path / f"01-{len(stamps)}.ipynb", cwd=cwd)
        stamps.append(single.stat().st_mtime_ns)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
                        str(NB / "01_single.ipynb")], cwd=tmp_path, capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    stamps.append(single.stat().st_mtime_ns)
    assert stamps[0] < stamps[1] < stamps[2]
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []
    assert not (NB / "artifacts").exists()
    assert load_meta(single.parent, "single")["global_batch"] == params.DEFAULTS.global_batch()


# --------------------------------------------------------------------------- planted faults


def _resave(d: Path, name: str, tensors=None, losses=None) -> None:
    """Rewrite artifact `name` through the library, its metadata kept."""
    meta = load_meta(d, name)
    extra = {k: v for k, v in meta.items() if k not in ("schema", "name", "losses", "fingerprint", "params")}
    save_artifact(d, name, tensors if tensors is not None else load_tensors(d, name),
                  losses if losses is not None else meta["losses"], **extra)


def _nudge(d: Path, name: str, tensor: str, rel: float) -> None:
    t = load_tensors(d, name)
    x = t[tensor].clone()
    x.view(-1)[0] += rel * x.abs().max()
    t[tensor] = x
    _resave(d, name, tensors=t)


def plant_rank_params(out: Path) -> None:
    _nudge(out / "curve", "rank1", "head.weight", 1e-6)


def plant_curve_step(out: Path) -> None:
    for r in (0, 1):  # both ranks, so they still agree: only the curve is off
        losses = load_meta(out / "curve", f"rank{r}")["losses"]
        losses[9] *= 1 + 1e-4
        _resave(out / "curve", f"rank{r}", losses=losses)


def plant_gradref_step(out: Path) -> None:
    _nudge(out / "step", "gradref", "block.attn.qkv", 1e-3)


@pytest.mark.parametrize("plant, failed, kept", [
    (plant_rank_params, "ranks", ("curve", "gradref")),
    (plant_curve_step, "curve", ("ranks", "gradref")),
    (plant_gradref_step, "gradref", ("ranks", "curve")),
])
def test_verdict_notebook_fails_on_a_planted_fault(gate_run, tmp_path, plant, failed, kept):
    _, _, clean = gate_run
    out = tmp_path / "out"
    shutil.copytree(clean, out, ignore=shutil.ignore_patterns("notebooks", "ckpts", "*.lock", "*.png",
                                                              "verdict.json"))
    plant(out)
    e = failing("04_compare_plots.ipynb", tmp_path / "04.ipynb", cwd=tmp_path, out=str(out))
    assert e.ename == "GateFailed"
    assert "FAIL" in e.evalue and f"[FAIL] {failed}:" in e.evalue
    v = json.loads((out / "verdict.json").read_text())
    assert not v["pass"] and not v["checks"][failed]["pass"]
    assert all(v["checks"][k]["pass"] for k in kept), v["reasons"]
    assert (out / "loss_delta.png").exists() and (out / "gradref.png").exists()  # drawn before it raised
    # the fault was judged, not "repaired" by producing the artifact again
    assert "producing" not in all_text(tmp_path / "04.ipynb")


def test_verdict_notebook_passes_on_clean_artifacts_without_producing(gate_run, tmp_path):
    _, _, clean = gate_run
    out = tmp_path / "out"
    shutil.copytree(clean, out, ignore=shutil.ignore_patterns("notebooks", "ckpts", "*.lock", "*.png",
                                                              "verdict.json"))
    run_nb("04_compare_plots.ipynb", tmp_path / "04.ipynb", cwd=tmp_path, out=str(out), produce=False)
    assert json.loads((out / "verdict.json").read_text())["pass"]


def test_pipeline_exits_1_and_prints_the_verdict_when_the_gate_fails(gate_run, tmp_path):
    _, _, clean = gate_run
    out = tmp_path / "out"
    shutil.copytree(clean, out, ignore=shutil.ignore_patterns("notebooks", "ckpts", "*.lock"))
    plant_rank_params(out)
    r = subprocess.run([sys.executable, "-m", "dormouse.gate.pipeline", "--quiet", "--only", "04",
                        "-p", "out", str(out)], cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"gate verdict for {out}: FAIL" in r.stdout and "[FAIL] ranks: ranks differ" in r.stdout
    assert (out / "notebooks" / "04_compare_plots.ipynb").exists()


# --------------------------------------------------------------------------- bad parameters in notebooks


@pytest.mark.parametrize("name, params, ename, words", [
    ("02_fleet_launcher.ipynb", {"world": "two"}, "ParameterError", ("world = 'two'", "whole number of ranks")),
    ("02_fleet_launcher.ipynb", {"world": 0}, "ParameterError", ("world = 0", "1 or more")),
    ("03_gradref.ipynb", {"world": 3}, "ParameterError", ("capacity = '4,2' has 2 entries but world = 3",)),
    ("01_single.ipynb", {"steps": 0}, "ParameterError", ("steps = 0", "1 or more")),
    ("04_compare_plots.ipynb", {"out": "UNWRITABLE"}, "ParameterError", ("cannot be written", "writable")),
    ("04_compare_plots.ipynb", {"produce": False}, "MissingArtifactError", ("missing", "produce = False")),
])
def test_bad_parameter_fails_the_first_cell_in_one_sentence(tmp_path, name, params, ename, words):
    params = {"out": str(tmp_path / "out"), **params}
    if params["out"] == "UNWRITABLE":
        (tmp_path / "file").write_text("")
        params["out"] = str(tmp_path / "file" / "out")
    e = failing(name, tmp_path / "run.ipynb", cwd=tmp_path, **params)
    assert e.ename == ename
    assert all(w in e.evalue for w in words), e.evalue
    assert "\n" not in e.evalue and e.evalue.endswith(".")
    # the notebook shows the sentence, not a traceback
    assert e.traceback == [f"{ename}: {e.evalue}"]
    i, cell = error_cell(tmp_path / "run.ipynb")
    if ename == "ParameterError":  # the first cell after the parameters (and papermill's injected ones)
        nb = nbformat.read(str(tmp_path / "run.ipynb"), as_version=4)
        before = [c for c in nb.cells[:i] if c.cell_type == "code"]
        assert "injected-parameters" in before[-1].metadata.get("tags", [])
        assert "params.check(" in cell.source
