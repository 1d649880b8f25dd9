"""Context parallelism gated through the Recorder (issue 40): tests/support/cp_loop.py trains a tiny causal
transformer with rotary positions whose sequence is sharded over a CP group of gloo ranks (attention through
torch's private templated ring on the CPU attention operator, or a plain ring of the loop's own; contiguous
shards or torch's head-tail load balancing), recorded with Recorder(context_parallel=dict(group, seq_dim,
order)) and judged against one process at the global batch. CP = 2 on 2 ranks (one launch) and CP 2 x DP 2
on 4 ranks (a second launch). Clean runs pass; each planted fault fails for its named cause. Every finding
is confirmed by a one-process computation of this file's own in plain PyTorch (the unparallelised model's
autograd on the global rows, built by the client's build_model; the recorded gradients read straight from
the rank files with safetensors), which imports nothing from dormouse. Beside them, the float32 merge of
torch's ring (_SDPAMerger) against its derived round-off bound, in one process."""

from __future__ import annotations

import math
from pathlib import Path

import casecheck
import catalogue
import looprec
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import cp_loop

cp = looprec.launched_fixture("cp", catalogue.runs("cp"), "cp_loop.py", 2)
cp_dp = looprec.launched_fixture("cp_dp", catalogue.runs("cp_dp"), "cp_loop.py", 4)

RUN = catalogue.runs("cp")  # each row's cp_loop options, for this file's one-process computation
BOUND = 1e-5  # the gate's float32 gradient bound (GRAD_RTOL); the clean runs' departures are stated below


# ------------------------------------------------------------------------ the test's own arithmetic

def recorded(out: Path, rank: int, step: int = 1) -> dict[str, torch.Tensor]:
    """Rank `rank`'s recorded gradient at `step`, read straight from its file."""
    t = load_file(str(out / f"rank{rank}" / f"step{step:06d}.safetensors"))
    return {n[2:]: v for n, v in t.items() if n.startswith("g/")}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def worst(got: dict, want: dict, names=None) -> float:
    return max(rel(got[n], want[n]) for n in (names or want))


def one_process(cfg: dict, world: int, positions: str = "global", loss: str = "token_mean") -> dict:
    """The unparallelised model's gradient at step 1 on the step's global rows (cp_loop's data rule, every
    DP replica's rows in one forward, attention over the whole sequence): the global token mean, or
    (loss="shard_means") the mean over every rank and micro-batch of its shard's own token mean, the
    weighting the loss_avg fault computes; positions "global" (each token's place) or "per_shard" (every
    contiguous shard's positions from 0)."""
    c = {**cp_loop.RUN, **cfg}
    n, T = c["cp"], c["T"]
    rows = world // n * c["micro"] * c["rows"]
    x, y = cp_loop.global_batch(c["seed"], 0, rows, T)
    model = cp_loop.build_model(c["seed"])
    pos = torch.arange(T).expand_as(x)
    if positions == "per_shard":
        pos = (torch.arange(T) % (T // n)).expand_as(x)
    z = model(input_ids=x, position_ids=pos)
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="none").view(y.shape)
    valid = y != -100
    if loss == "token_mean":
        L = ce[valid].sum() / valid.sum()
    else:  # each (micro-batch, shard): its own token mean, averaged over ranks and micro-batches
        L, s = 0.0, T // n
        for m in range(rows // c["rows"]):
            r = slice(m * c["rows"], (m + 1) * c["rows"])
            for j in range(n):
                t = slice(j * s, (j + 1) * s)
                L = L + (ce[r, t] * valid[r, t]).sum() / valid[r, t].sum()
        L = L / (rows // c["rows"] * n)
    L.backward()
    return {k: p.grad for k, p in model.named_parameters()}


# ------------------------------------------------------------------------ the catalogue's rows

@casecheck.rows("cp", "cp_dp")
def test_the_verdict_is_the_catalogues(request, case):
    """Clean runs pass; each planted fault fails for its named cause (tests/support/catalogue.py): on 2
    ranks (cp) and 4 (cp_dp)."""
    casecheck.holds(request.getfixturevalue(case.fleet)[case.id], case)


# ------------------------------------------------------------------------ clean runs

@pytest.mark.parametrize("run", ["clean", "clean_lb", "plain_lb"])
def test_a_clean_context_parallel_run_equals_one_process_on_two_ranks(cp, run):
    v = looprec.verdict(cp[run])  # its row: PASS, the layout named
    assert v.check("gradient").worst < BOUND, v.check("gradient").reason
    # independently: both ranks' recorded gradient is the plain model's on the whole sequence
    want = one_process(RUN[run], 2)
    for rank in (0, 1):
        assert worst(recorded(cp[run], rank), want) < BOUND


def test_the_leader_records_the_global_rows_and_the_peer_its_shard(cp):
    """rank 0 holds the group's whole rows in sequence order (positions 0..T-1 after load balancing), rank 1
    none of the step's global batch but its own shard kept apart."""
    t0 = load_file(str(cp["clean_lb"] / "rank0" / "step000001.safetensors"))
    t1 = load_file(str(cp["clean_lb"] / "rank1" / "step000001.safetensors"))
    T = cp_loop.RUN["T"]
    assert torch.equal(t0["in/0/position_ids"], torch.arange(T).expand(2, T))
    assert torch.equal(t1["tp/0/position_ids"][0], torch.cat([torch.arange(4, 8), torch.arange(8, 12)]))
    x, y = cp_loop.global_batch(1, 0, 2, T)
    assert torch.equal(t0["in/0/input_ids"], x) and torch.equal(t0["in/0/loss_labels"], y)
    assert not any(k.startswith("in/") for k in t1)


@pytest.mark.parametrize("run", ["clean", "no_cp_reduce"])
def test_cp_by_dp_on_four_ranks(cp_dp, run):
    want = one_process(catalogue.runs("cp_dp")[run], 4)  # its row: the verdict
    if run == "clean":
        assert all(worst(recorded(cp_dp[run], r), want) < BOUND for r in range(4))
        return
    # independently: the CP group's two gradients (each reduced over DP) sum to one process's
    g0, g1 = recorded(cp_dp[run], 0), recorded(cp_dp[run], 1)
    assert worst(g0, want) > 0.1
    assert worst({n: g0[n] + g1[n] for n in g0}, want) < BOUND


# ------------------------------------------------------------------------ faults

def test_the_non_contiguous_all_gather_gives_a_wrong_dk_which_the_loss_cannot_see(cp):
    """torch.distributed.nn.functional.all_gather on gloo (pytorch #192920): the attention's output, dQ and dV
    right, dK wrong. The logged loss passes; the gradient fails and the probe finds the gradient parting at
    the key projection's output."""
    # (its row: loss passes, gradient and probe fail, the key projection named)
    # independently: in the last layer only the key projection's gradient is wrong
    want, got = one_process(RUN["nn_gather"], 2), recorded(cp["nn_gather"], 0)
    right = ["layers.1.attn.q.weight", "layers.1.attn.v.weight", "layers.1.attn.o.weight", "head.weight"]
    assert worst(got, want, right) < BOUND
    assert rel(got["layers.1.attn.k.weight"], want["layers.1.attn.k.weight"]) > 0.1


def test_a_loss_averaged_over_the_cp_ranks_shard_means_fails_named_by_the_shards_token_counts(cp):
    # (its row: gradient and probe fail, the scales named) independently: the fleet computed the mean of
    # the shards' token means, not the token mean
    got = recorded(cp["loss_avg"], 0)
    assert worst(got, one_process(RUN["loss_avg"], 2)) > 1e-2
    assert worst(got, one_process(RUN["loss_avg"], 2, loss="shard_means")) < BOUND


def test_gradients_not_all_reduced_over_the_cp_group_fail_named(cp):
    want = one_process(RUN["no_cp_reduce"], 2)
    g0, g1 = recorded(cp["no_cp_reduce"], 0), recorded(cp["no_cp_reduce"], 1)
    assert worst(g0, want) > 0.1 and worst({n: g0[n] + g1[n] for n in g0}, want) < BOUND


def test_gradients_averaged_over_the_cp_group_are_half_of_one_process(cp):
    """The shards' parts averaged where they must be summed: every rank's gradient is one process's times 1/2
    (its row: the gradient line names 1 / the CP size, not the TP size)."""
    want = one_process(RUN["cp_avg"], 2)
    assert worst(recorded(cp["cp_avg"], 0), {n: g * 0.5 for n, g in want.items()}) < BOUND


def test_positions_not_shifted_per_shard_fail_named_though_the_gradient_matches_its_rows(cp):
    """One process fed the recorded positions computes the fleet's gradient (the gradient check passes): only
    the positions say that every shard was encoded as the sequence's start."""
    got = recorded(cp["positions"], 0)
    assert worst(got, one_process(RUN["positions"], 2, positions="per_shard")) < BOUND
    assert worst(got, one_process(RUN["positions"], 2)) > 1e-2


def test_load_balanced_keys_reassembled_in_rank_order_fail_named_at_the_attention(cp):
    assert worst(recorded(cp["lb_order"], 0), one_process(RUN["lb_order"], 2)) > 1e-2


def test_a_load_balanced_cut_declared_contiguous_fails_named_by_the_positions(cp):
    """The fleet computed the right gradient; the declaration assembles another sequence for one process."""
    assert worst(recorded(cp["declared_order"], 0), one_process(RUN["declared_order"], 2)) < BOUND


# ------------------------------------------------------------------------ torch's float32 merge

def merge_bound(n: int, L: float, M: float) -> float:
    """The float32 round-off of torch's _SDPAMerger over n blocks, per output element (docs/parallelisms.md
    derives it): u = 2^-24, M = max |V| (every block output and the merged one are convex combinations of V's
    rows), L = the largest |logsumexp| of the blocks and the merge. The cast of each block to float32 costs
    u M + 2 u L M (an lse error e moves the output by at most 2 M e); each merge step
    out - sigmoid(x) (out - b), x = lse_b - lse, adds u M (13 + L) + M e_i, where e_i, the running lse's
    error, grows by u (11 L + 4) a step (lse - logsigmoid(lse - lse_b))."""
    u = 2.0 ** -24
    return u * M * (1 + 2 * L + (n - 1) * (13 + 2 * L) + (11 * L + 4) * (n - 1) * (n - 2) / 2)


@pytest.mark.parametrize("n", [2, 4])
def test_torch_rings_float32_merge_stays_within_its_derived_bound(n):
    """Each CP rank's merge of its queries' attention over the ring's key blocks (contiguous: rank c merges
    blocks c, c-1, ..., 0 as the ring delivers them), in float64 inputs so that the merge's own float32
    round-off (convert_to_f32=True, torch's default) is all that departs from one process's SDPA; with
    convert_to_f32=False the merge is float64's."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    g = torch.Generator().manual_seed(n)
    for scale in (1.0, 4.0):  # 4: logsumexps near 75, where the lse's terms dominate the bound
        q, k, v = (scale * torch.randn(2, 2, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        s, M = 32 // n, float(v.abs().max())
        for c in range(n):
            for f32 in (True, False):
                merger, lses = _SDPAMerger(f32, seq_dim=2), []
                for i in range(c + 1):
                    r = c - i
                    o, lse = op(q[:, :, c * s:(c + 1) * s], k[:, :, r * s:(r + 1) * s], v[:, :, r * s:(r + 1) * s],
                                0.0, i == 0)
                    merger.step(o, lse, False)
                    lses.append(lse)
                out, lse = merger.results()
                err = float((out - whole[:, :, c * s:(c + 1) * s]).abs().max())
                L = max(float(x.abs().max()) for x in lses + [lse])
                if f32:
                    assert err <= merge_bound(c + 1, L, M), (n, c, scale, err, merge_bound(c + 1, L, M))
                else:  # the float64 merge: what departs in float32 is the merge's rounding, not the ring
                    assert err <= 1e-3 * merge_bound(c + 1, L, M), (n, c, scale, err)


def test_a_bad_context_parallel_declaration_is_one_clear_line(tmp_path):
    from dormouse.errors import DormouseError
    from dormouse.gate import Recorder, RecordingSpec

    model = cp_loop.build_model(0)
    for spec, words in ((dict(order="zigzag"), "order='zigzag': one of contiguous, load_balanced"),
                        (dict(seq_dim=0), "seq_dim=0: the inputs' sequence dimension"),
                        (dict(group=None, chunks=2), "a dict(group=<the CP process group>"),
                        (dict(order="contiguous"), "context_parallel without torch.distributed initialised")):
        with pytest.raises(DormouseError) as e:
            Recorder(tmp_path / "rec", model, RecordingSpec(build_model="cp_loop:build_model",
                                                            build_optimizer="cp_loop:build_optimizer",
                                                            objective="token_mean"), context_parallel=spec)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
