"""The bench's report: the printed table and docs/benchmarks.md, both from one
bench.json (`python -m dormouse.bench --render JSON` rewrites them without
measuring)."""

from __future__ import annotations

import time
from pathlib import Path

from dormouse.bench.page import write_head
from dormouse.bench.rates import BF16_MATMUL_SIZES, MATMUL_SIZES


def _speed_against_fp32(bf16: float, fp32: float) -> str:
    """'4.4x faster than fp32' or '69x slower than fp32' (the rate ratio, whichever way it goes)."""
    if bf16 >= fp32:
        return f"{bf16 / fp32:.1f}x faster than fp32"
    return f"{fp32 / bf16:.0f}x slower than fp32" if fp32 / bf16 >= 10 else f"{fp32 / bf16:.1f}x slower than fp32"


def _fmt(v, spec=".3g") -> str:
    return "null" if v is None else format(v, spec)


def _spread(ratio: dict) -> str:
    return f"{ratio['min']:.3f}..{ratio['max']:.3f}"


def _line(key: str, value: str, note: str = "") -> str:
    return f"{key:<24} {value:>12}  {note}"


def recorder_table(res: dict) -> str:
    """The Recorder's rows alone (DP and 2-D, one run's), as the table prints them."""
    L: list[str] = []
    recorder_rows(res, lambda key, value, note="": L.append(_line(key, value, note)))
    return "\n".join(L)


def format_table(res: dict) -> str:
    d = res["details"]
    s = d["single"]
    prof = s["profile"]
    fl = d.get("fleet", {})
    lf = res.get("fleet_launch_fixed_s") or {}
    L = []
    L.append(f"dormouse bench ({res['mode']}) - {res['meta']['cpus']} CPUs, torch {res['meta']['torch']}, "
             f"1 thread per process")
    L.append(f"{'figure':<24} {'value':>12}  note")
    L.append("-" * 96)

    def row(key, value, note=""):
        L.append(_line(key, value, note))

    row("tokens_per_s_tiny", _fmt(res["tokens_per_s_tiny"], ".0f"),
        f"batch {s['shapes']['tiny'][0]} x {s['shapes']['tiny'][1]}, step {s['tiny_step_s'] * 1e3:.1f} ms")
    row("tokens_per_s_small", _fmt(res["tokens_per_s_small"], ".0f"),
        f"batch {s['shapes']['small'][0]} x {s['shapes']['small'][1]}, step {s['small_step_s'] * 1e3:.0f} ms")
    row("matmul_rate_gflops", _fmt(res["matmul_rate_gflops"], ".1f"),
        f"fp32 square n={','.join(map(str, MATMUL_SIZES))}, median of rounds")
    row("matmul_fraction_small", _fmt(res["matmul_fraction_small"], ".3f"),
        f"{s['small_flops']['total'] / 1e9:.1f} GFLOP/step at {s['small_achieved_gflops']:.1f} GFLOP/s (goal >= 0.5)")
    if "matmul_rate_bf16_gflops" in res:
        ar = s["step_parts_at_rates"]
        row("matmul_rate_bf16_gflops", _fmt(res["matmul_rate_bf16_gflops"], ".2f"),
            f"bf16 square n={','.join(map(str, BF16_MATMUL_SIZES))}, median of rounds "
            f"({_speed_against_fp32(res['matmul_rate_bf16_gflops'], res['matmul_rate_gflops'])})")
        ns = ar["parts"]["newton_schulz"]
        row("matmul_fraction_by_dtype", _fmt(res["matmul_fraction_by_dtype"], ".3f"),
            f"each part at its dtype's rate: model {ar['parts']['model']['dtype']} "
            f"{ar['parts']['model']['ideal_s'] * 1e3:.0f} ms + Newton-Schulz {ns['dtype']} "
            f"{ns['ideal_s'] * 1e3:.0f} ms ideal (optimizer.step took {ns['optimizer_step_s'] * 1e3:.0f} ms)")
        c = s["ns_cliff_small"]
        nat = s.get("ns_native_cliff_small")
        row("ns_cliff_small", _fmt(res["ns_cliff_small"], ".3f"),
            f"small step, default (ns {s['ns_kernel']!r} kernel) / ns_dtype=float32 "
            f"{s['small_ns_float32_step_s'] * 1e3:.0f} ms, median of {c['n']} rounds, spread "
            f"{_spread(c)} (goal <= 1.3)"
            + (f"; native bf16 kernel {nat['median']:.2f}x, spread {_spread(nat)}" if nat else ""))
        sb = res["sample_bytes_per_s_small"]
        sr = sb.get("ratios")
        row("sample_bytes_per_s_small", _fmt(sb["within_window"], ".0f"),
            f"generate(), small, one thread: within the window; sliding (prompt of max_seq_len) "
            f"{sb['sliding']:.0f} bytes/s"
            + (f"; uncached {sb['uncached']:.0f}, forward with cache {sb['forward_cache']:.0f}, a batch of "
               f"{sb['batch_size']} samples {sb['batch']:.0f} bytes/s. Cached / uncached "
               f"{sr['cached_vs_uncached']['median']:.2f}x (spread {_spread(sr['cached_vs_uncached'])}), "
               f"/ forward with cache {sr['cached_vs_forward_cache']['median']:.2f}x "
               f"({_spread(sr['cached_vs_forward_cache'])}); batch / uncached "
               f"{sr['batch_vs_uncached']['median']:.2f}x ({_spread(sr['batch_vs_uncached'])}), / forward with "
               f"cache {sr['batch_vs_forward_cache']['median']:.2f}x ({_spread(sr['batch_vs_forward_cache'])}); "
               f"medians of {len(sb['per_round']['batch'])} rounds" if sr else ""))
    if res.get("fleet_vs_ddp") is not None:
        med, r = fl["step_s_median"], fl["ratios"]
        row("fleet_vs_ddp", _fmt(res["fleet_vs_ddp"], ".3f"),
            f"median of {fl['rounds']} rounds, spread {_spread(r['fleet_vs_ddp'])}; ours {med['ours'] * 1e3:.0f} ms / "
            f"DDP {med['ddp'] * 1e3:.0f} ms per train() step (goal <= 1.0); "
            f"params equal: {fl['ours_vs_ddp_max_abs_param_diff'] == 0}")
        row("scaling_efficiency", _fmt(res["scaling_efficiency"], ".3f"),
            f"spread {_spread(r['scaling_efficiency'])}; fleet {fl['fleet_tokens_per_s']:.0f} tok/s vs 2 x solo "
            f"{fl['solo_tokens_per_s']:.0f} (DDP: {fl['ddp_scaling_efficiency']:.3f}, spread "
            f"{_spread(r['ddp_scaling_efficiency'])}; goal >= 0.9)")
        row("  contention", _fmt(fl["contention_efficiency"], ".3f"),
            f"solo {med['solo'] * 1e3:.0f} ms / both ranks busy, no communication {med['both'] * 1e3:.0f} ms")
        row("  communication", _fmt(fl["communication_efficiency"], ".3f"),
            f"both-busy {med['both'] * 1e3:.0f} ms / fleet {med['ours'] * 1e3:.0f} ms")
    else:
        row("fleet_vs_ddp", "null", d.get("fleet_error", ""))
        row("scaling_efficiency", "null", "")
    ex = d.get("exact", {})
    if res.get("exact_vs_ring") is not None:
        med = ex["step_s_median"]
        row("exact_vs_ring", _fmt(res["exact_vs_ring"], ".3f"),
            f"{ex['world_size']} ranks x batch {ex['batch_per_rank']} in micro-batches of {ex['micro_batch']}: "
            f"exact {med['exact'] * 1e3:.0f} ms / ring {med['ring'] * 1e3:.0f} ms, median of {ex['rounds']} rounds, "
            f"spread {_spread(ex['ratios']['exact_vs_ring'])} (goal <= 1.1)")
    else:
        row("exact_vs_ring", "null", d.get("exact_error", ""))
    pl = d.get("pipeline", {})
    row("pipeline_verdict_s", _fmt(res.get("pipeline_verdict_s"), ".1f"),
        f"tiny `dormouse pipeline`: verdict printed (goal <= 10 s); whole run "
        f"{_fmt(res.get('pipeline_wall_s'), '.1f')} s, exit {pl.get('pipeline_exit')}" if pl else "")
    for k, v in (res.get("pipeline_parts_s") or {}).items():
        row(f"  {k}", _fmt(v, ".1f"), "alone, in one process (the fleet: its torchrun launches)")
    sens = d.get("sensitivity", {})
    row("gate_smallest_caught_eps", _fmt(res.get("gate_smallest_caught_eps")),
        f"rank {sens.get('rank')} x (1 + eps N(0,1)) at step {sens.get('step')}; largest passed "
        f"{_fmt(sens.get('largest_passed'))}" if sens else "")
    recorder_rows(res, row)
    if lf:
        row("fleet_launch_fixed_s", "", "")
        row("  import_torch_s", _fmt(lf["import_torch_s"], ".2f"),
            f"python -c 'import torch' (bare interpreter {lf['python_bare_s']:.2f} s)")
        row("  torchrun_rendezvous_s", _fmt(lf["torchrun_rendezvous_s"], ".2f"),
            f"2 ranks forked from torchrun's agent (--run-path --start-method fork: the tests' fleets, the bench's): "
            f"init_process_group + barrier + destroy (in-rank {lf['rank_init_and_barrier_s']:.2f} s); "
            f"a fresh interpreter per rank: {_fmt(lf.get('torchrun_rendezvous_exec_s'), '.2f')} s")
    L.append("")
    L.append(f"where the time goes (small step, torch.profiler, {prof['profiled_step_s'] * 1e3:.0f} ms/step "
             f"profiled, ops' self time {prof['ops_self_s_per_step'] * 1e3:.0f} ms):")
    for k, v in prof["breakdown"].items():
        extra = ""
        if k == "matmul kernels" and prof.get("matmul_kernel_gflops"):
            extra = (f"  non-attention matmul FLOPs ran at {prof['matmul_kernel_gflops']:.1f} GFLOP/s in "
                     f"these kernels (median square-matmul rate: {prof['rate_gflops']:.1f})")
        L.append(f"  {k:<26} {v:6.1%}{extra}")
    fl_s = s["small_flops"]
    parts = {k[6:] if k.startswith("train_") else k: v for k, v in fl_s.items() if k not in ("forward", "total")}
    L.append("  FLOPs/step by part: " + ", ".join(f"{k} {v / fl_s['total']:.0%}" for k, v in
                                                  sorted(parts.items(), key=lambda kv: -kv[1]) if v))
    L.append("top ops (self CPU time):")
    for t in res["profile_small_top"]:
        L.append(f"  {t['op'][:52]:<52} {t['share']:6.1%}  {t['ms_per_step']:7.1f} ms/step  "
                 f"{t['calls_per_step']:6.0f} calls/step")
    for key, what in (("fleet", "2-rank"), ("exact", "4-rank")):
        la = d.get(key, {}).get("loadavg_before_after")
        if la:
            L.append(f"load average (1 min) before/after the {what} rounds: {la[0][0]:.2f} / {la[1][0]:.2f} "
                     f"on {res['meta']['cpus']} CPUs")
    wall, sec = res["meta"].get("wall_s"), res["meta"].get("sections_s")
    if wall is not None:
        L.append(f"wall time of this run: {wall:.0f} s = {int(wall // 60)} min {wall % 60:.0f} s"
                 + (" (goal for a full run: <= 10 min)" if res["mode"] == "full" else "")
                 + ("; by section: " + ", ".join(f"{k} {v:.0f} s" for k, v in sec.items()) if sec else ""))
    for n in res.get("notes", []):
        L.append(f"note: {n}")
    L.append(f"written: {res['meta']['json']}")
    return "\n".join(L)


def recorder_rows(res: dict, row) -> None:
    """The Recorder's rows: the plain DDP run's (dormouse.bench.recorder), then the 2-D run's beside them."""
    rb = res["details"].get("recorder")
    if rb:
        o, j = rb["overhead"], rb["judge_cost"]
        row("recorder_overhead", _fmt(res["recorder_overhead"], ".3f"),
            f"sketch k=256 every step, median of {rb['rounds']} rounds of {rb['steps']} timed steps (after one "
            f"warm-up), spread {_spread(o['sketch'])}; CPU {o['sketch']['cpu_ratio']:.3f}, inside rec.step "
            f"{o['sketch']['in_step_fraction']:.1%} of the step; full tensors {o['full']['median']:.3f} (CPU "
            f"{o['full']['cpu_ratio']:.3f}, inside {o['full']['in_step_fraction']:.1%}), sketch every 10th "
            f"{o['sketch_every10']['median']:.3f} (inside {o['sketch_every10']['in_step_fraction']:.1%}; "
            f"{rb['params']} params, {rb['tokens_per_rank_step']} tokens/rank/step; goal <= 1.05)")
        row("recorder_judge_cost", _fmt(res["recorder_judge_cost"], ".2f"),
            f"gate check {j['sketch']['judge_cpu_s']:.1f} CPU s / fleet {j['sketch']['fleet_cpu_s']:.1f} CPU s "
            f"(sketched, {j['sketch']['verdict']}); full tensors {j['full']['ratio']:.2f} ({j['full']['verdict']}); "
            "goal <= 3")
    else:
        row("recorder_overhead", "null", res["details"].get("recorder_error", "")[:80])
    recorder_2d_rows(res, row)


def recorder_2d_rows(res: dict, row) -> None:
    """The 2-D run's Recorder rows (dormouse.bench.recorder_2d), beside the DP ones."""
    rb = res["details"].get("recorder_2d")
    if not rb:
        if "recorder_2d_overhead" in res:  # a bench.json from before the section: no row
            row("recorder_2d_overhead", "null", res["details"].get("recorder_2d_error", "")[:80])
        return
    o, j = rb["overhead"], rb["judge_cost"]
    row("recorder_2d_overhead", _fmt(res["recorder_2d_overhead"], ".3f"),
        f"2-D run, dp 2 x tp 2 (FSDP2 + TP, {rb['world']} ranks): sketch k=256 every step, median of "
        f"{rb['rounds']} rounds of {rb['steps']} timed steps (after one warm-up), spread {_spread(o['sketch'])}; "
        f"CPU {o['sketch']['cpu_ratio']:.3f}, inside rec.step {o['sketch']['in_step_fraction']:.1%} of the step; "
        f"full tensors {o['full']['median']:.3f} (spread {_spread(o['full'])}, CPU {o['full']['cpu_ratio']:.3f}, "
        f"inside {o['full']['in_step_fraction']:.1%}); plain step {rb['step_s_median']['none'] * 1e3:.0f} ms "
        f"({rb['params']} params, {rb['tokens_per_rank_step']} tokens/rank/step)")
    row("recorder_2d_judge_cost", _fmt(res["recorder_2d_judge_cost"], ".2f"),
        f"gate check {j['sketch']['judge_cpu_s']:.1f} CPU s / fleet {j['sketch']['fleet_cpu_s']:.1f} CPU s "
        f"(sketched, {j['sketch']['verdict']}); full tensors {j['full']['ratio']:.2f} ({j['full']['verdict']})")


def docs_page(res: dict) -> str:
    """docs/benchmarks.md, generated from one bench.json: never typed by hand."""
    m = res["meta"]
    when = time.strftime("%Y-%m-%d", time.gmtime(m["unix_time"]))
    return "\n".join([
        "# Benchmarks",
        "",
        f"Generated by `dormouse bench --docs docs/benchmarks.md` from one `{res['mode']}` run "
        f"({when}; {m['cpus']} CPUs, torch {m['torch']}, Python {m['python']}, one thread per process; "
        f"1-minute load average {m['loadavg_start'][0]:.1f} at the start and {m['loadavg_end'][0]:.1f} at the end). "
        "Ratios are taken side by side in the same run, each the median of per-round ratios with its spread "
        "(min..max); absolute figures move with the machine's load. The keys are described in "
        "`python -m dormouse.bench --help`.",
        "",
        "```",
        format_table(res),
        "```",
        "",
    ])


def write_docs(page: Path, res: dict) -> None:
    """The page from one bench.json, keeping its accelerator section (bench.device writes that one)."""
    write_head(page, docs_page(res))
