"""The scale page (`python -m dormouse.bench --scale`): transformers' Trainer
on GPT-2 configurations of real size (examples/scale/hf_gpt2.py: random
init, the real 50,257-token vocabulary, 2 CPU ranks, per-device batch 2,
sequence 128, 3 steps), recorded for the gate and checked, at each size:

- the Recorder's overhead: the run's wall time recorded (sketch k=256 every
  step; full tensors every step) over the same run without the Recorder;
- disk per recorded step (every rank's step files, each mode);
- one training rank's peak resident memory (the larger rank's, recorded in
  full tensors);
- `dormouse gate check` on the full recording: its wall time against the
  recorded run's, its peak resident memory against one training rank's,
  and its verdict.

Each command runs in its own process tree, its resident memory read from
/proc every 0.2 s (the peak of each process, and the tree killed past
--kill-gb: a size the machine cannot hold is reported, not fatal to it).
Sizes: tiny (about 0.5M parameters, a 256-token vocabulary), mini (2 x 128,
about 6.9M, the real vocabulary), mid (6 x 384,
about 30M), small (GPT-2 small, 124M), medium (350M) where the machine has
the memory. Recordings go to a temporary folder, removed size by size.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dormouse.bench.paths import repo_root

SCRIPT = Path("examples") / "scale" / "hf_gpt2.py"
# sizes run by another script of examples/scale: (script, its SCALE)
OTHER = {"llama": ("llama_fsdp2.py", "small"), "llama_tiny": ("llama_fsdp2.py", "tiny")}
GB = 1 << 30


def _children() -> dict[int, int]:
    """{pid: parent pid} of every process (from /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def measured(cmd: list[str], *, env: dict, cwd: Path, kill_bytes: int, log) -> dict:
    """Run `cmd`; its wall time, exit status, each process's peak RSS (bytes, by
    pid: its command line and peak), the tree's peak, whether it was killed."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, list] = {}
    tree_peak, killed = 0, False
    lines: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    while p.poll() is None:
        parents = _children()
        tree, todo = {p.pid}, [p.pid]
        while todo:
            q = todo.pop()
            for c, pp in parents.items():
                if pp == q and c not in tree:
                    tree.add(c)
                    todo.append(c)
        total = 0
        for q in tree:
            r = _rss(q)
            total += r
            if q not in peaks:
                peaks[q] = [_cmdline(q), 0, 0.0]
            peaks[q][1] = max(peaks[q][1], r)
            peaks[q][2] = max(peaks[q][2], _cpu(q))  # the last reading before it ends
        tree_peak = max(tree_peak, total)
        if total > kill_bytes and not killed:
            killed = True
            log(f"  killed: the process tree held {total / GB:.1f} GB (--kill-gb {kill_bytes / GB:.1f})")
            os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    reader.join(timeout=5)
    return {"wall_s": time.perf_counter() - t0, "rc": p.returncode, "killed": killed, "tree_peak": tree_peak,
            "cpu_s": sum(v[2] for v in peaks.values()),
            "peaks": {q: v for q, v in peaks.items() if v[1]}, "output": "".join(lines)[-4000:]}


def _disk_per_step(out: Path, steps: int) -> float:
    files = [f for r in out.glob("rank*") if r.is_dir() for f in r.iterdir() if f.name.startswith("step")]
    return sum(f.stat().st_size for f in files) / max(steps, 1)


def _rank_peak(res: dict, script: str) -> float:
    """The largest training rank's peak RSS (the processes running the script, not torchrun's agent)."""
    ranks = [v[1] for v in res["peaks"].values() if script in v[0] and "torch.distributed.run" not in v[0]
             and "torchrun" not in v[0]]
    return max(ranks, default=0)


def _verdict(output: str) -> str:
    """PASS, or FAIL with the failing checks' names (and the first one's words), or the not-judged line."""
    lines = output.splitlines()
    said = next((ln.rsplit(": ", 1)[-1].strip() for ln in lines if "gate verdict for" in ln), None)
    failed = [ln.strip()[len("[FAIL] "):] for ln in lines if ln.strip().startswith("[FAIL]")]
    if said is None:
        return next((ln.strip() for ln in lines if "not judged" in ln), lines[-1].strip() if lines else "")
    if said == "PASS" or not failed:
        return said
    names = ", ".join(f.split(":", 1)[0] for f in failed)
    return f"{said} ({names}: {failed[0].split(':', 1)[1].strip()[:100]}...)"


# the planted faults (examples/scale/hf_gpt2.py's FAULT) and the environment each needs
FAULT_ENV = {"scale1.001": {}, "scale1.001_pre": {}, "no_avg_tokens": {}, "local_norm": {},
             "micro_mean": {"ACCUM": "2"}}


def _environ() -> dict:
    """The children's environment: this one's, with Python writing bytecode as it does by default (a
    PYTHONDONTWRITEBYTECODE in the caller's environment would make every process compile transformers
    afresh, some 20 s of each start); warm() writes it once before anything is timed."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def warm(log) -> None:
    """Import what the runs and the check import once, untimed, so that no timed process compiles it."""
    log("  warm-up: importing torch, transformers and dormouse's gate once (bytecode written)")
    subprocess.run([sys.executable, "-c", "import torch, torch.distributed.run, transformers, dormouse.gate.__main__, "
                    "dormouse.gate.record.hf; from transformers import GPT2LMHeadModel, LlamaForCausalLM, "
                    "Qwen3MoeForCausalLM, Trainer"], env=_environ(), check=False)


def _spec(size: str) -> tuple[str, str, dict]:
    """(script, its SCALE, extra environment) of a --sizes entry: a size, or size@B for B rows per rank-step."""
    name, _, batch = size.partition("@")
    script, scale = OTHER.get(name, (SCRIPT.name, name))
    return script, scale, {"BATCH": batch} if batch else {}


def tokens_per_rank_step(size: str) -> int:
    """Rows per rank-step x the sequence (both scripts' defaults: 2 x 128)."""
    batch = size.partition("@")[2]
    return int(batch or 2) * int(os.environ.get("SEQ", "128"))


def one_fault(size: str, fault: str, *, steps: int, tmp: Path, kill_bytes: int, threads: int, log) -> dict:
    """A planted fault at this size, recorded in full tensors and checked: the verdict and its first failing line."""
    root = repo_root()
    script, scale, extra = _spec(size)
    env = {**_environ(), "SCALE": scale, "STEPS": str(steps), "OMP_NUM_THREADS": "1", "SKETCH": "0", "FAULT": fault,
           **extra, **FAULT_ENV.get(fault, {}),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out = tmp / f"{size}-{fault}"
    log(f"  {size}: fault {fault}: training ...")
    res = measured([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                    str(out)], env=env, cwd=root / SCRIPT.parent, kill_bytes=kill_bytes, log=log)
    got: dict = {"train_rc": res["rc"], "train_wall_s": res["wall_s"]}
    if res["rc"] == 0:
        log(f"  {size}: fault {fault}: gate check ...")
        chk = measured([sys.executable, "-m", "dormouse", "gate", "check", "--out", str(out), "--threads",
                        str(threads)], env=env, cwd=root / SCRIPT.parent, kill_bytes=kill_bytes, log=log)
        fails = [ln.strip() for ln in chk["output"].splitlines() if ln.strip().startswith("[FAIL]")]
        got.update(check_rc=chk["rc"], check_wall_s=chk["wall_s"], peak_gb=max(
            (v[1] for v in chk["peaks"].values()), default=0) / GB, verdict=_verdict(chk["output"]), fails=fails)
    else:
        got["error"] = res["output"][-600:]
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(Path(str(out) + "-trainer"), ignore_errors=True)
    return got


def one_size(size: str, *, steps: int, tmp: Path, kill_bytes: int, threads: int, log, partial=None,
             modes: tuple = ("full", "check", "none", "sketch"), sharded: int = 0) -> dict:
    root = repo_root()
    cwd = root / SCRIPT.parent
    script, scale, extra = _spec(size)
    base = {**_environ(), "SCALE": scale, "STEPS": str(steps), "OMP_NUM_THREADS": "1", **extra,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]
    row: dict = {"size": size, "steps": steps}
    # full tensors (and the check) first: the figures a short allocation must not lose
    for mode, extra in (("full", {"SKETCH": "0"}), ("none", {"RECORD": "0"}), ("sketch", {"SKETCH": "256"})):
        if mode not in modes:
            continue
        out = tmp / f"{size}-{mode}"
        log(f"  {size}: training, recorder {mode} ...")
        res = measured(run + [str(out)], env={**base, **extra}, cwd=cwd, kill_bytes=kill_bytes, log=log)
        row[mode] = {"wall_s": res["wall_s"], "cpu_s": res["cpu_s"], "rc": res["rc"], "killed": res["killed"],
                     "rank_peak_gb": _rank_peak(res, script) / GB}
        if mode != "none" and res["rc"] == 0:
            row[mode]["disk_per_step_gb"] = _disk_per_step(out, steps) / GB
        if res["rc"] != 0:
            row[mode]["error"] = res["output"][-600:]
        if mode == "full" and res["rc"] == 0 and "check" in modes:
            log(f"  {size}: gate check ...")
            chk = measured([sys.executable, "-m", "dormouse", "gate", "check", "--out", str(out), "--threads",
                            str(threads)], env=base, cwd=cwd, kill_bytes=kill_bytes, log=log)
            row["check"] = {"wall_s": chk["wall_s"], "cpu_s": chk["cpu_s"], "rc": chk["rc"], "killed": chk["killed"],
                            "peak_gb": max((v[1] for v in chk["peaks"].values()), default=0) / GB,
                            "verdict": _verdict(chk["output"]), "output": chk["output"][-3000:]}
            if sharded:
                log(f"  {size}: gate check sharded over {sharded} ranks ...")
                shd = measured([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={sharded}", "-m", "dormouse", "gate", "check", "--out", str(out),
                                "--force"],  # the reference made again, sharded (not the one-process one's)
                               env=base, cwd=cwd, kill_bytes=kill_bytes, log=log)
                row["check_sharded"] = {"ranks": sharded, "wall_s": shd["wall_s"], "cpu_s": shd["cpu_s"],
                                        "rc": shd["rc"], "killed": shd["killed"], "verdict": _verdict(shd["output"]),
                                        "peak_gb": max((v[1] for v in shd["peaks"].values()), default=0) / GB,
                                        "same_verdict": _verdict(shd["output"]) == row["check"]["verdict"],
                                        "output": shd["output"][-3000:]}
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(Path(str(out) + "-trainer"), ignore_errors=True)
        if partial is not None:
            partial(row)
    return row


def ratios(row: dict) -> dict:
    none, sk, full, chk = row.get("none", {}), row.get("sketch", {}), row.get("full", {}), row.get("check", {})
    r = {}
    if none.get("wall_s") and sk.get("rc") == 0:
        r["overhead_sketch"] = sk["wall_s"] / none["wall_s"]
    if none.get("wall_s") and full.get("rc") == 0:
        r["overhead_full"] = full["wall_s"] / none["wall_s"]
    if chk and full.get("wall_s"):
        r["check_time_ratio"] = chk["wall_s"] / full["wall_s"]
    if chk and full.get("cpu_s"):
        r["check_cpu_ratio"] = chk["cpu_s"] / full["cpu_s"]
    if none.get("cpu_s") and full.get("cpu_s"):
        r["overhead_full_cpu"] = full["cpu_s"] / none["cpu_s"]
    if none.get("cpu_s") and sk.get("cpu_s"):
        r["overhead_sketch_cpu"] = sk["cpu_s"] / none["cpu_s"]
    if chk and full.get("rank_peak_gb"):
        r["check_memory_ratio"] = chk["peak_gb"] / full["rank_peak_gb"]
    return r


def _label(row: dict) -> str:
    """'small (124M), 256 tokens': the size, its parameters and the tokens per rank-step."""
    tokens = row.get("tokens_per_rank_step") or tokens_per_rank_step(row["size"])
    return f"{row['size'].partition('@')[0]} ({row.get('params_m', '?')}M), {tokens} tokens"


def table(rows: list[dict]) -> str:
    head = ("| model | run unrecorded → sketched → full (s) | recorded / unrecorded, sketched / full | disk per step sketched / "
            "full | one training rank's peak | `gate check` wall (× the full run's wall; CPU × its CPU) | check peak (× a rank's) | "
            "verdict |")
    lines = [head, "|" + "---|" * 8]
    for row in rows:
        if not any(row.get(m) for m in ("none", "sketch", "full")):
            continue  # a size measured for its planted faults alone (faults_table)
        n, s, f, c, r = row.get("none", {}), row.get("sketch", {}), row.get("full", {}), row.get("check", {}), \
            ratios(row)

        def w(x):
            if not x:
                return "—"  # not measured in this run (--modes)
            return "killed" if x.get("killed") else f"{x['wall_s']:.0f}" if x.get("rc") == 0 else "failed"

        lines.append(
            f"| {_label(row)} | {w(n)} → {w(s)} → {w(f)} | "
            f"{r.get('overhead_sketch', float('nan')):.2f} / {r.get('overhead_full', float('nan')):.2f} (CPU "
            f"{r.get('overhead_sketch_cpu', float('nan')):.2f} / {r.get('overhead_full_cpu', float('nan')):.2f}) | "
            f"{s.get('disk_per_step_gb', float('nan')):.3f} / {f.get('disk_per_step_gb', float('nan')):.2f} GB | "
            f"{f.get('rank_peak_gb', float('nan')):.2f} GB | "
            + (f"{c['wall_s']:.0f} s ({r.get('check_time_ratio', float('nan')):.2f} ×; CPU "
               f"{r.get('check_cpu_ratio', float('nan')):.2f} ×) | "
               f"{c['peak_gb']:.2f} GB ({r.get('check_memory_ratio', float('nan')):.2f} ×) | {c['verdict'][:90]} |"
               if c else "— | — | — |"))
    return "\n".join(ln.replace(" (CPU nan / nan)", "").replace("; CPU nan ×", "").replace("nan / nan", "—")
                     .replace("nan / ", "— / ") for ln in lines)


FAULT_WORDS = {
    "scale1.001": "rank 1's synchronised gradient x 1.001 (after the reduce)",
    "scale1.001_pre": "rank 1's gradient x 1.001 before the all-reduce",
    "no_avg_tokens": "`average_tokens_across_devices=False`",
    "local_norm": "clipped by the rank's local norm",
    "micro_mean": "the mean of micro-batch means (GA 2)",
}


def faults_table(rows: list[dict]) -> str:
    """One line per (size, planted fault): the verdict, the failing checks and the first one's words."""
    lines = ["| model | planted fault | verdict | `gate check` peak | the first failing line |", "|---|---|---|---|---|"]
    for row in rows:
        for fault, got in row.get("faults", {}).items():
            first = got.get("fails", [""])[0][len("[FAIL] "):] if got.get("fails") else got.get("error", "")[-200:]
            first = first.replace("|", "/")
            n = got.get("steps", row.get("steps"))  # a merged row's faults keep their own run's steps
            steps = f", {n} steps" if n else ""
            lines.append(f"| {_label(row)}{steps} | {FAULT_WORDS.get(fault, fault)} | "
                         f"{got.get('verdict', 'training failed').split(' (')[0]} | "
                         f"{got.get('peak_gb', float('nan')):.2f} GB | "
                         f"{first[:400]}{'...' if len(first) > 400 else ''} |")
    return "\n".join(lines)


PARAMS_M = {"tiny": 0.5, "mini": 6.9, "mid": 30, "small": 124, "medium": 355, "moe": 133, "llama": 125,
            "llama_tiny": 0.4}


def scale_main(sizes: list[str], *, steps: int, out: Path, docs: Path | None, kill_gb: float | None,
               threads: int, faults: tuple = (), modes: tuple = ("full", "check", "none", "sketch"),
               sharded: int = 0) -> int:
    from dormouse import atomic

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if kill_gb is None:
        from dormouse.gate.budget import available

        kill_gb = 0.9 * available() / GB
    rows = []
    warm(log)
    t0 = time.perf_counter()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dormouse-scale-") as tmp:
        for size in sizes:
            def partial(row, done=tuple(rows)):  # what is measured so far, written as it comes
                atomic.write_text(out, json.dumps({"rows": [*done, row], "partial": True}, indent=1) + "\n")

            row = one_size(size, steps=steps, tmp=Path(tmp), kill_bytes=int(kill_gb * GB), threads=threads, log=log,
                           partial=partial, modes=modes, sharded=sharded)
            for fault in faults:
                row.setdefault("faults", {})[fault] = one_fault(size, fault, steps=steps, tmp=Path(tmp),
                                                                kill_bytes=int(kill_gb * GB), threads=threads, log=log)
                partial(row)
            row["params_m"] = PARAMS_M.get(size.partition("@")[0], "?")
            row["tokens_per_rank_step"] = tokens_per_rank_step(size)
            row.update(ratios(row))
            rows.append(row)
            log(table([row]).splitlines()[-1])
    res = {"rows": rows, "meta": {"cpus": os.cpu_count(), "loadavg_start": load, "loadavg_end": os.getloadavg(),
                                  "wall_s": time.perf_counter() - t0, "check_threads": threads, "steps": steps,
                                  "unix_time": time.time()}}
    atomic.write_text(out, json.dumps(res, indent=1) + "\n")
    print(table(rows))
    if docs is not None:
        from dormouse.bench.page import SCALE, write_section

        write_section(docs, page_section(res), heading=SCALE)
    return 0


def merged(results: list[dict]) -> dict:
    """Several runs of the scale bench as one: a size's row from the runs that measured it (the clean runs'
    figures from the last run that has them, its faults from every run), the load of each run."""
    rows: dict[str, dict] = {}
    for res in results:
        for row in res["rows"]:
            into = rows.setdefault(row["size"], {"size": row["size"]})
            faults = {**into.get("faults", {}), **{f: {"steps": row.get("steps"), **got}
                                                    for f, got in row.get("faults", {}).items()}}
            into.update({k: v for k, v in row.items() if v not in ({}, None)})
            if faults:
                into["faults"] = faults
    metas = [r["meta"] for r in results if "meta" in r]
    return {"rows": list(rows.values()), "meta": {
        "cpus": metas[-1]["cpus"] if metas else os.cpu_count(), "steps": metas[-1]["steps"] if metas else 3,
        "check_threads": metas[-1]["check_threads"] if metas else 2,
        "loads": [(m["loadavg_start"][0], m["loadavg_end"][0]) for m in metas]}}


def render_scale(paths: list[Path], *, docs: Path | None) -> int:
    """`python -m dormouse.bench --scale --render a.json,b.json [--docs docs/benchmarks.md]`."""
    res = merged([json.loads(p.read_text()) for p in paths])
    text = page_section(res)
    if docs is not None:
        from dormouse.bench.page import SCALE, write_section

        write_section(docs, text, heading=SCALE)
    print(text)
    return 0


def _sharded_line(rows: list[dict]) -> str:
    done = [(r, r["check_sharded"]) for r in rows if r.get("check_sharded")]
    return " ".join(
        f"{r['size']}: the sharded reference over {c['ranks']} ranks (`torchrun --nproc_per_node {c['ranks']} -m "
        f"dormouse gate check`) took {c['wall_s']:.0f} s against one process's {r['check']['wall_s']:.0f} s, each "
        f"process at most {c['peak_gb']:.2f} GB (one process: {r['check']['peak_gb']:.2f} GB), verdict "
        f"{c['verdict'][:60]}{' (the same)' if c.get('same_verdict') else ' (NOT the same)'}." for r, c in done)


def page_section(res: dict) -> str:
    m = res["meta"]
    loads = m.get("loads") or [(m["loadavg_start"][0], m["loadavg_end"][0])]
    rows = res["rows"]
    faults = faults_table(rows) if any(r.get("faults") for r in rows) else ""
    return "\n".join([
        "## At scale", "",
        f"Generated by `python -m dormouse.bench --scale` ({m['cpus']} CPUs; the runs' 1-minute load averages at "
        f"their start and end: {', '.join(f'{a:.1f} → {b:.1f}' for a, b in loads)}; several runs merged by "
        "`--scale --render a.json,b.json --docs docs/benchmarks.md`). Models of real size, random init, 2 CPU "
        "ranks (gloo, one thread each), sequence 128, per-rank batch 2 unless the row says more tokens, "
        f"{m['steps']} optimizer steps, AdamW, clipping at 1.0: GPT-2 configurations and a Qwen3-MoE "
        "(8 experts, 2 routed) under transformers' `Trainer` (examples/scale/hf_gpt2.py; the real 50,257-token "
        "vocabulary but for tiny's 256), and a Llama-style model trained by a plain FSDP2 loop "
        "(examples/scale/llama_fsdp2.py, a 32,000-token vocabulary). `gate check` runs on the full-tensor "
        f"recording with `--threads {m['check_threads']}` (the two cores the ranks trained on). Wall times include "
        "each process's start (imports, model build); peaks are resident memory read every 0.2 s; CPU seconds "
        "are every process's user + system time.", "",
        table(rows), "",
        "The goals: the check's peak at most 1.5 × one recorded training rank's, its wall time at most 3 × the "
        "recorded run's; recording at most 1.1 × (sketched) and 1.3 × (full) the unrecorded run's wall time at "
        "256 tokens a rank-step. Recording costs O(parameters) a step (hashing, sketching, copying, writing) and "
        "training O(parameters × tokens): its ratio falls as the tokens per rank-step grow (the rows with more "
        "tokens). The check differentiates every micro-batch at every step (the gradient and the replay are "
        "judged at every recorded step) and, at the first step, the extras a budget states in the verdict (rows "
        "alone and merged, the module probe): a 3-step run carries the first step's extras over few steps. "
        "At this size the check's time went as much to the kernel as to arithmetic: each gradient-sized tensor "
        "it allocated was a fresh mapping whose pages the kernel faulted in and zeroed. `gate check` therefore "
        "asks torch's allocator for transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`, unless set) and lets the "
        "C heap reuse the blocks it frees: on the Llama row's recording, checked alone with 2 threads, that took "
        "the page faults from 44 to 2 million and the check from 289 s (one thread) and 160 s (two) to 78 s, "
        "its peak from 4.81 to 4.87 GB.",
        "",
        *([_sharded_line(rows), ""] if any(r.get("check_sharded") for r in rows) else []),
        *(["Planted faults, recorded in full tensors at that size and checked (the verdict's first failing line, "
           "cut at 400 characters; their runs shared the machine with other work, so no times are given):", "",
           faults, ""] if faults else []),
    ])
