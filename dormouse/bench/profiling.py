"""Where a step's time goes: torch.profiler over train()'s steps, by op and by kind of work."""

from __future__ import annotations

from dormouse.bench.stepper import Stepper


_CATEGORIES = (
    ("matmul kernels", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm",
                        "aten::matmul", "aten::linear", "aten::_addmm_activation")),
    ("attention kernel", ("scaled_dot_product", "flash_attention")),
    ("copies/indexing/fills", ("aten::copy_", "aten::cat", "aten::index", "aten::_index_put_impl_",
                               "aten::index_put_", "aten::index_select", "aten::gather", "aten::scatter",
                               "aten::fill_", "aten::zero_", "aten::clone", "aten::contiguous",
                               "aten::_to_copy", "aten::embedding", "aten::sort", "aten::argsort",
                               "aten::bincount", "aten::topk", "aten::stack", "aten::constant_pad_nd",
                               "aten::empty", "aten::zeros", "aten::new_zeros", "aten::scatter_add_",
                               "aten::index_add_", "aten::embedding_dense_backward")),
)


def _category(name: str) -> str:
    for cat, keys in _CATEGORIES:
        if any(name == k or (k.startswith(("scaled", "flash")) and k in name) for k in keys):
            return cat
    if name.startswith("aten::"):
        return "elementwise/reductions"
    return "autograd/other"


def profile_steps(stepper: Stepper, steps: int, flops_per_step: float, rate_gflops: float) -> dict:
    """torch.profiler over `steps` steps of one train() call (its first step,
    with train()'s set-up, the profiler's warm-up; it steps the profiler from
    train()'s on_step hook): top ops by self CPU time, and a breakdown by
    kind of work."""
    from torch.profiler import ProfilerActivity, profile, schedule

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=steps),
                 acc_events=True) as prof:
        timed = stepper.train(steps, lambda step, model, info: prof.step())
    wall = sum(timed)
    rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()
            if not e.key.startswith("ProfilerStep")]  # the schedule's own step annotations
    total = sum(s for _, s, _ in rows) or 1e-12
    rows.sort(key=lambda r: -r[1])
    top = [{"op": k, "share": s / total, "ms_per_step": 1e3 * s / steps, "calls_per_step": c / steps}
           for k, s, c in rows[:8]]
    cats: dict[str, float] = {}
    for k, s, _ in rows:
        cats[_category(k)] = cats.get(_category(k), 0.0) + s
    matmul_s = cats.get("matmul kernels", 0.0) / steps
    attn_s = cats.get("attention kernel", 0.0) / steps
    return {
        "top": top,
        "breakdown": {k: v / total for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "profiled_step_s": wall / steps,
        "ops_self_s_per_step": total / steps,
        "matmul_kernel_s_per_step": matmul_s,
        "attention_kernel_s_per_step": attn_s,
        "flops_per_step": flops_per_step,
        "rate_gflops": rate_gflops,
    }
