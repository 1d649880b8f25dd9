"""Sampling speed: dormouse.infer's generators, kind beside kind, round by round."""

from __future__ import annotations

import statistics
import time

import torch

from dormouse.bench.stats import ratio_summary
from dormouse.config import preset


def sampling_rate(name: str = "small", tokens: int = 100, seed: int = 0, rounds: int = 5, batch: int = 16) -> dict:
    """Bytes per second of dormouse.infer's generators on random-init weights
    (temperature 1, one thread: the speed does not depend on what was learnt),
    in `rounds` rounds, the kinds alternating inside each round:

    within_window  generate() from a 4-byte prompt (cached: the prompt through
                   the forward, then the Decoder's one-position step per byte);
    uncached       the same bytes recomputed over the whole text every byte
                   (use_cache=False, the reference the cache must equal);
    forward_cache  the same, one position per byte through DormouseModel.forward
                   with the KV cache (the previous round's generator);
    sliding        generate() from a prompt of max_seq_len bytes (every byte
                   slides the window);
    batch          generate_many(samples=batch): all rows' bytes per second.

    Each figure is the median over rounds, and each ratio the median of the
    per-round ratios with its spread (min..max)."""
    from dormouse.infer import generate, generate_many
    from dormouse.model import DormouseModel

    torch.manual_seed(seed)
    model = DormouseModel(preset(name)).eval()
    window = model.cfg.max_seq_len
    short, full = b"def ", (bytes(range(32, 127)) * (window // 95 + 1))[:window]
    n = min(tokens, window - len(short))

    def forward_cache() -> None:  # the previous generator: forward(cache=...) per byte
        with torch.no_grad():
            cache, x = model.new_cache(), torch.tensor([list(short)])
            for _ in range(n):
                x = model(x, cache=cache)[0][:, -1].argmax(-1, keepdim=True)

    kinds = {
        "within_window": (n, lambda: generate(model, short, tokens=n, temperature=1.0, seed=seed)),
        "uncached": (n, lambda: generate(model, short, tokens=n, temperature=1.0, seed=seed, use_cache=False)),
        "forward_cache": (n, forward_cache),
        "sliding": (tokens, lambda: generate(model, full, tokens=tokens, temperature=1.0, seed=seed)),
        "batch": (batch * n, lambda: generate_many(model, short, samples=batch, tokens=n, temperature=1.0,
                                                   seed=seed)),
    }
    generate_many(model, b"ab", samples=2, tokens=2)  # warm-up
    per_round = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind, (count, fn) in kinds.items():
            t0 = time.perf_counter()
            fn()
            per_round[kind].append(count / (time.perf_counter() - t0))
    out = {k: statistics.median(v) for k, v in per_round.items()}
    out["batch_size"], out["tokens"], out["per_round"] = batch, n, per_round

    def ratio(a: str, b: str) -> dict:
        return ratio_summary([x / y for x, y in zip(per_round[a], per_round[b])])

    out["ratios"] = {"cached_vs_uncached": ratio("within_window", "uncached"),
                     "cached_vs_forward_cache": ratio("within_window", "forward_cache"),
                     "batch_vs_uncached": ratio("batch", "uncached"),
                     "batch_vs_forward_cache": ratio("batch", "forward_cache")}
    return out
