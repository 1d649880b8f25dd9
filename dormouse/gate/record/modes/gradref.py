"""gradref: the data rule by its own arithmetic. Its own profile parser and
span rule (not the trainer's FleetPlan or data helpers), the bytes every
window of every step must hold (their sha256 digests), the tokens it counts,
and the held-out loss at the fleet's recorded parameters (the documented eval
rule), written into the recording's reference folder (gradref.json)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from dormouse.digest import fingerprint, window_digest
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import GRADREF, RecordingSet, gate_reference_path, write_gate_json
from dormouse.gate.record.modes.base import mode
from dormouse.gate.settings import GateSettings

def profile(text: str, world: int, batch: int, seq_len: int) -> list[tuple[int, int]]:
    """(windows, window length) per rank, read from the profile by gradref's
    own parsing (not the trainer's FleetPlan: gradref shares no code with it)."""
    if not text:
        return [(batch, seq_len)] * world
    out = []
    for entry in text.split(","):
        m = re.fullmatch(r"([0-9]+)(?:x([0-9]+))?", entry.strip())
        out.append((int(m.group(1)), int(m.group(2) or seq_len)))
    return out


def span_index(step: int, n: int, order: str, seed: int) -> int:
    """Which whole span step `step` (0-based) reads, from the documented rule:
    epoch = step // n, j = step % n; sequential: j; shuffle: perm[j] with
    perm = randperm(n) from a generator seeded with seed * 1_000_003 + epoch."""
    epoch, j = divmod(step, n)
    if order == "sequential":
        return j
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return int(torch.randperm(n, generator=g)[j])


def step_windows(corpus: bytes, train_bytes: int, prof: list[tuple[int, int]], step: int, order: str,
                 seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per rank, its windows (x, y) at `step`, each of T+1 consecutive bytes of
    the step's span; ranks' slices follow one another in rank order."""
    span = sum(b * (t + 1) for b, t in prof)
    n = train_bytes // span
    pos = span_index(step, n, order, seed) * span
    ranks = []
    for b, t in prof:
        wins = []
        for _ in range(b):
            w = torch.tensor(list(corpus[pos:pos + t + 1]), dtype=torch.int64)
            wins.append((w[:-1].unsqueeze(0), w[1:].unsqueeze(0)))  # (1, T) each
            pos += t + 1
        ranks.append(wins)
    return ranks


def run_gradref(s: GateSettings, log=print) -> dict:
    """The data rule by gradref's own arithmetic, at every step of the fleet's
    recording (reference/gradref.json): the windows each step must hold
    (bytes read from the corpus by the documented rule, each rank's slice in
    rank order; each window's sha256, window_digest), which the judge holds
    every window the fleet's forwards saw to, the tokens counted from the
    targets it built, and under an eval recipe the held-out loss at the
    fleet's recorded parameters after each eval step."""
    fleet = RecordingSet(s.out_dir)
    fleet.validate()
    m = mode(s, name=GRADREF, dist=False)
    t = m.run.train
    prof = profile(s.profile, s.world, s.batch, t.seq_len)
    corpus = Path(t.data).read_bytes()
    train_bytes = len(corpus) - int(len(corpus) * t.eval_frac)
    rows = []
    for k in fleet.steps:
        windows = [torch.cat([x[0], y[0, -1:]]) for r in step_windows(corpus, train_bytes, prof, k - 1,
                                                                         t.data_order, s.seed) for x, y in r]
        rows.append({"step": k, "windows": [window_digest(w.tolist()) for w in windows],
                     "tokens": sum(len(w) - 1 for w in windows)})
    evals = []
    model = m.model().to(m.device)
    init = fingerprint(m.start_state(model)[0])  # the settings' own initial state, built here
    if t.eval_every:  # at the fleet's steps the recipe evaluates, from its recorded state after them
        for k in fleet.steps:
            if k % t.eval_every == 0:
                model.load_state_dict({**fleet.state_after(k, A.PARAM), **fleet.state_after(k, A.BUFFER)})
                evals.append([k, eval_loss(model, corpus, train_bytes, t.seq_len, m.device)])
    log(f"gradref: {len(rows)} steps, {len(prof)} ranks, {rows[0]['tokens'] if rows else 0} tokens per step")
    meta = m.gate_extra(init, run=fleet.run, steps=rows, evals=evals,
                        config=m.run.to_dict(),
                        profile=[list(p) for p in prof])
    write_gate_json(gate_reference_path(s.out_dir, GRADREF), meta)
    return meta


EVAL_WINDOWS = 64  # the documented eval rule reads at most this many held-out windows


@torch.no_grad()
def eval_loss(model, corpus: bytes, train_bytes: int, seq_len: int, device) -> float:
    """The eval loss by gradref's own arithmetic from the documented rule: the
    held-out tail is corpus[train_bytes:]; its first n = min(len // (T+1), 64)
    windows of T+1 consecutive bytes, each computed alone; the token mean of
    their per-token losses, sum_i l_i / (n T), summed in float64."""
    n = min((len(corpus) - train_bytes) // (seq_len + 1), EVAL_WINDOWS)
    total, count = 0.0, 0
    for i in range(n):
        w = torch.tensor(list(corpus[train_bytes + i * (seq_len + 1):train_bytes + (i + 1) * (seq_len + 1)]),
                         dtype=torch.int64)
        x, y = w[:-1].unsqueeze(0).to(device), w[1:].unsqueeze(0).to(device)
        logits = model(x, y)[0]
        total += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double().sum())
        count += y.numel()
    return total / count
