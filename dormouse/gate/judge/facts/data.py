"""Fact 3's data half for any loop: which examples each rank read.

A recording of any loop (entry.judge_recording):

data          no example read by two ranks (or twice) in one step; none twice
              within an epoch: the loop's (rec.step(epoch=...)) or inferred
              from dataset_len (check_data states the rule; skipped, and said,
              when neither is known). Examples are their ids when given, else
              their tokens' hash: identical rows are then named as such.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.judge.verdict import Check


def _row_ids(batch: dict[str, torch.Tensor]) -> list[str]:
    """Each row's identity: its "idx"/"example_id" (exact), else a sha1 of its
    tokens (input_ids where attention_mask is 1): identical content, one id."""
    for key in ("idx", "example_id"):
        if key in batch:
            return [f"id:{int(x)}" for x in batch[key].reshape(-1)]
    return _row_hashes(batch)


def _row_hashes(batch: dict[str, torch.Tensor]) -> list[str]:
    """A sha1 of each row's tokens (input_ids where attention_mask is 1)."""
    ids = batch.get("input_ids", batch.get("arg0"))
    if ids is None:
        return []
    mask = batch.get("attention_mask")
    out = []
    for i in range(ids.shape[0]):
        row = ids[i] if mask is None else ids[i][mask[i].bool()]
        out.append(hashlib.sha1(row.to(torch.int64).contiguous().numpy().tobytes()).hexdigest())
    return out


def _identical_ranks(rec: A.RecordingSet, k: int) -> tuple[tuple[int, int], int] | None:
    """Two ranks whose rows at step k are identical token for token (every
    row, in order; by _row_hashes): ((q, r), rows), else None."""
    seen: dict[tuple[str, ...], int] = {}
    for r in range(rec.world_at(k)):
        rows = tuple(h for rr, _, b in rec.micro_batches(k) if rr == r for h in _row_hashes(b))
        if not rows:
            continue
        if rows in seen:
            return (seen[rows], r), len(rows)
        seen[rows] = r
    return None


def _reads(rec: A.RecordingSet, k: int) -> tuple[list[tuple[int, list[str]]], bool]:
    """Step k's reads: (rank, the row ids it read in the step, micro-batches
    in order) per rank, and whether every id is exact (given) rather than a
    content hash."""
    groups, exact = [], True
    for r in range(rec.world_at(k)):
        given = rec.example_ids(r, k)
        if given is not None:
            groups.append((r, [f"id:{int(x)}" for x in given]))
            continue
        ids = [i for rr, _, b in rec.micro_batches(k) if rr == r for i in _row_ids(b)]
        exact = exact and all(i.startswith("id:") for i in ids)
        groups.append((r, ids))
    return groups, exact


def _labels_apart(rec: A.RecordingSet) -> str | None:
    """A rank whose labels are not its input tokens (at most half its targets are) where another rank's are
    its input tokens at every target (the causal-LM convention: labels = input_ids, -100 where not trained):
    labels altered on some ranks alone (zeroed on one rank's device copy), which every other check takes as
    given, since the gate's one process reads the labels the fleet's forward got. None otherwise (ranks
    whose labels are all their inputs, or all something else: another objective's labels)."""
    seen: dict[int, list] = {}  # rank -> [targets equal to the input token, targets, up to 2 target values]
    for k in rec.steps:
        for r, _, b in rec.micro_batches(k):
            y, x = b.get(A.LOSS_LABELS, b.get("labels")), b.get("input_ids", b.get("arg0"))
            if y is None or x is None or y.shape != x.shape:
                continue
            on = y != -100
            s = seen.setdefault(r, [0, 0, set()])
            s[0], s[1] = s[0] + int((on & (y == x)).sum()), s[1] + int(on.sum())
            if len(s[2]) < 2:
                s[2] |= set(y[on].unique()[:2].tolist())
    same = [r for r, s in sorted(seen.items()) if s[1] and s[0] == s[1]]
    apart = [r for r, s in sorted(seen.items()) if s[1] and s[0] <= s[1] / 2]
    if not same or not apart:
        return None
    r = apart[0]
    agree, total, values = seen[r]
    what = f"; every target is token {next(iter(values))}" if len(values) == 1 else ""
    return (f"rank {r}'s labels are not its input tokens at {total - agree} of its {total} targets{what}, where "
            f"rank(s) {', '.join(map(str, same))}'s labels are their input tokens at every target: "
            f"the labels were altered on rank {', '.join(map(str, apart))} alone (zeroed or overwritten on that "
            "rank's device copy?) and the fleet trained towards them; the gate's one process reads the labels the "
            "forward got, so every other check takes them as given")


def _ids_against_corpus(rec: A.RecordingSet) -> tuple[str | None, str]:
    """Where the recording names the corpus its example ids are byte offsets
    into: (the first recorded row whose inputs or targets are not the
    corpus's bytes at its id -- a read below the offsets the loop reports, a
    micro-batch re-read, a read that ignores its start -- or None; why the
    ids could not be checked, or ""). A corpus no longer at its path, or
    changed since the recording (its sha256), leaves the ids as given and
    says so: the run is not blamed for a file moved or edited after it."""
    import numpy as np

    path = rec.spec.example_corpus
    if not path:
        return None, ""
    p = Path(path)
    if not p.is_file():
        return None, f"not checked against the corpus: {str(p)!r} is no longer there"
    if rec.recorded.example_corpus_sha256 not in (None, A.file_hash(p)):
        return None, f"not checked against the corpus: {str(p)!r} changed since the recording (sha256)"
    corpus = np.memmap(p, dtype=np.uint8, mode="r")
    windows: dict = {}  # epoch -> [(first byte, end, step, rank)] of every window read in it
    for k in rec.steps:
        epoch = rec.step_meta(0, k).get("epoch")
        for r in range(rec.world_at(k)):
            ids = rec.example_ids(r, k)
            if ids is None:
                continue
            rows = []  # (inputs, targets or None) of each row, in micro-batch order
            for rr, _, b in rec.micro_batches(k):
                x, y = b.get("input_ids", b.get("arg0")), b.get("labels", b.get("arg1"))
                if rr == r and x is not None:
                    rows += [(x[i], None if y is None else y[i]) for i in range(x.shape[0])]
            if len(rows) != ids.numel():
                return (f"at step {k} rank {r} recorded {len(rows)} rows under {ids.numel()} example ids: the "
                        "loop's ids do not match its reads (give one id per row, in the order read)"), ""
            for i, (at, (x, y)) in enumerate(zip(ids.tolist(), rows)):
                T, at = x.shape[0], int(at)
                for part, got, start in (("inputs", x, at), ("targets", y, at + 1)):
                    want = corpus[start:start + T]
                    if got is not None and (want.shape[0] != T or not np.array_equal(want, got.numpy())):
                        return (f"at step {k} rank {r}'s row {i}: its {part} are not the {T} bytes of {p.name} "
                                f"at byte {start} (its example id {at}): the loop read other bytes than its ids "
                                "say (a micro-batch read twice, a read that ignores its offset, another "
                                "window's targets)"), ""
                windows.setdefault(epoch, []).append((at, at + T + 1, k, r))
    for epoch, spans in windows.items():  # a window is read once an epoch, and none overlaps another
        spans.sort()
        for (a0, e0, k0, r0), (a1, _, k1, r1) in zip(spans, spans[1:]):
            if a0 < a1 < e0:  # an exact repeat is the id check's (an example read twice)
                return (f"windows overlap within epoch {epoch}: rank {r0}'s at byte {a0} (step {k0}) runs to byte "
                        f"{e0}, past the start of rank {r1}'s at byte {a1} (step {k1}): the loop's reads are not "
                        "the disjoint windows one process reads (a wrong offset between ranks or steps)"), ""
    return None, ""


EVEN_BATCHES = ("a read twice is what HF's Trainer does at an uneven end of an epoch: accelerate's even_batches "
                "fills the last step's batch on every rank with the epoch's first examples, which one process "
                "does not read again (dataloader_drop_last=True, or a dataset that divides by the global batch, "
                "trains each example once an epoch)")


IDENTICAL = ("the data check identifies examples by a hash of their tokens, so identical rows (duplicates in "
             "the dataset) cannot be told from one example read twice: identical rows: pass example_ids=... to "
             "rec.step (the sampler's indices) to tell them apart")


def _identical_words(k: int, same) -> str:
    """Two ranks whose rows at step k are identical though the loop's ids differ."""
    (q, r), rows = same
    return (f"at step {k} ranks {q} and {r} read identical rows, token for token (all "
            f"{rows} of them, in order), though the example ids the loop gave differ: "
            "every rank read the same data (no DistributedSampler?) and the ids do not "
            "describe the reads; only a dataset that repeats every one of those rows, in "
            "that order, under other ids would read so")


def _twice_in_step(k: int, e: str, q: int, r: int, whole: tuple, groups, exact: bool, replayed: bool) -> str:
    """Example e, read at step k by rank q and again by rank r (r = q: one rank twice), in words."""
    if not replayed:
        who = f"ranks {q} and {r}" if q != r else f"rank {r}"
        return f"at step {k} {who} read identical rows (equal tokens); {IDENTICAL}"
    if q != r:
        if exact and tuple(dict(groups)[q]) != whole:
            return (f"at step {k} example {e.removeprefix('id:')} was read by ranks {q} and {r}: the ranks' reads "
                    "overlap (each rank must read its own share: a DistributedSampler, or shards of the data)")
        ident = "" if exact else " (all its rows, in order: the same step's reads)"
        return (f"at step {k} an example was read by ranks {q} and {r}{ident}: every rank read the same data (no "
                "DistributedSampler?)")
    return f"at step {k} an example was read by rank {r} twice in one step"


def _again_words(k0: int, r0: int, k: int, r: int, epoch: int, even_batches: bool) -> str:
    """Rows rank r0 read at step k0 and rank r at step k, identical by their tokens: the HF/accelerate
    advice where it can be the cause (that client, or the epoch's last step), else the shards'."""
    why = EVEN_BATCHES if even_batches else ("the ranks' shards overlap or a rank reads a row again within the "
                                             "epoch (each row must be read once an epoch: disjoint shards)")
    return (f"rows read by rank {r0} at step {k0} and by rank {r} at step {k} are identical (equal tokens) within "
            f"epoch {epoch}; {why}; {IDENTICAL}")


def _read_twice(k: int, groups, exact: bool, cur: dict, cur_groups: set, epoch: int, src: str,
                even_batches: bool = False) -> str | None:
    """The first example step k reads twice: by two ranks, by one rank twice, or again within the epoch
    (`cur`: id -> (the step, the rank) that read it, `cur_groups` the epoch's whole reads; `src` what the
    epochs are; `even_batches`: accelerate's fill can be the cause, named then)."""
    seen: dict[str, int] = {}  # id -> rank, within this step
    step_groups: dict[tuple[str, ...], int] = {}
    for r, ids in groups:
        whole = tuple(ids)
        replayed = exact or whole in step_groups or whole in cur_groups
        for e in ids:
            if e in seen:
                return _twice_in_step(k, e, seen[e], r, whole, groups, exact, replayed)
            if e in cur:
                if not replayed:
                    return _again_words(*cur[e], k, r, epoch, even_batches)
                return f"an example was read twice within epoch {epoch} (steps {cur[e][0]} and {k}, {src})"
            seen[e] = r
        step_groups[whole] = r
    return None


def _unreached(rec: A.RecordingSet) -> tuple[str | None, str]:
    """The forwards with gradients on whose output no backward reached (the Recorder's
    "unreached_forwards": not micro-batches): (a failure where one of them held rows its rank did not
    train on ("unreached_untrained"): a loss left out of the backward, or a metric over other rows, which
    the recording cannot tell apart, and whose counts on two ranks may cancel; the words that say where
    forwards over trained rows were dropped)."""
    steps = {}
    for k in rec.steps:
        metas = [rec.step_meta(r, k) for r in range(rec.world_at(k))]
        counts = [int(m.get("unreached_forwards") or 0) for m in metas]
        fresh = [int(m.get("unreached_untrained", m.get("unreached_forwards")) or 0) for m in metas]
        if any(fresh):
            r = max(range(len(fresh)), key=fresh.__getitem__)
            return (f"at step {k} rank {r} ran {fresh[r]} forward(s) with gradients on over rows it did not train "
                    "on (no backward reached them): a micro-batch's loss left out of the backward (detached, or "
                    "never added in), or a metric over other rows computed with gradients on, which the recording "
                    "cannot tell apart (compute a metric under torch.no_grad())"), ""
        if any(counts):
            steps[k] = counts
    if not steps:
        return None, ""
    n = sum(sum(c) for c in steps.values())
    where = ", ".join(str(k) for k in list(steps)[:5]) + (" ..." if len(steps) > 5 else "")
    return None, (f"; {n} forward(s) with gradients on over rows the rank trained on, whose output no backward "
                  f"reached (metrics computed without torch.no_grad(); steps {where}), were not taken as "
                  "micro-batches")


def _passed_words(rec: A.RecordingSet, all_exact: bool, unverified: str, epochs: list, reads: int, n: int) -> str:
    """The pass: how examples were identified, and which epochs the once-per-epoch check held to."""
    how = "by the example ids given" if all_exact else "by their tokens' hash (no example_ids given)"
    if all_exact and rec.spec.example_corpus:
        how += f" ({unverified})" if unverified else ", every row the corpus's bytes at its id"
    given = ("" if all_exact and rec.spec.example_corpus and not unverified else
             "; the rows are taken as given: the gate judges the rows that reached the model's forward, not "
             "what the dataset holds (a collator that alters them on one rank is not seen)")
    if all(e is not None for e in epochs):
        return (f"no example was read by two ranks in any step, none twice within any of the "
                f"loop's epochs (rec.step(epoch=...): {len(set(epochs))} epoch(s), {reads} reads; "
                f"examples identified {how}){given}")
    if not n:
        return (f"no example was read by two ranks in any step (examples identified {how}); "
                "dataset_len unknown and no rec.step(epoch=...): the once-per-epoch check was "
                f"skipped{given}")
    return (f"no example was read by two ranks in any step, none twice within an epoch of at "
            f"most {n} examples ({reads} reads; epochs inferred from dataset_len: a new one at "
            f"the first step that would pass it; examples identified {how}){given}")


def check_data(rec: A.RecordingSet) -> Check:
    """No example read twice in one step (by two ranks, or one rank twice),
    none twice within an epoch.

    Identity: example ids (rec.step(example_ids=...) or an "idx"/"example_id"
    input) are exact; without them a row is its tokens' hash. A repeat of
    content is then called a double read (a data-order bug) only when all of
    a rank's rows in a step, in order, repeat another rank's in that step or
    a rank's in an earlier step of the epoch (every rank reading the same
    data, an epoch replayed after a resume); a repeat of single rows is named as
    identical rows, which the hash cannot tell from one example read twice.

    Epochs: the loop's own (rec.step(epoch=...)) when every step carries one;
    else inferred from dataset_len n: an epoch runs from its first step while
    its reads stay within n, and the next epoch begins at the first step whose
    reads would take it past n. A DataLoader with drop_last (and a
    DistributedSampler with drop_last) leaves fewer than one step's reads R of
    an epoch unread (at most (W - 1) + W (K B - 1) = R - 1), so each epoch's
    reads plus the next step's exceed n and the rule finds the loop's epochs;
    a loop that leaves more unread must pass epoch=.

    Ids are taken as given, unless the recording names the corpus they are
    byte offsets into (RecordingSpec(example_corpus=...), dormouse's own loop):
    then every recorded row must be the corpus's bytes at its id first
    (_ids_against_corpus), so the ids describe what was read."""
    wrong, unverified = _ids_against_corpus(rec)
    if wrong:
        return Check("data", False, wrong)
    labels = _labels_apart(rec)
    if labels:
        return Check("data", False, labels)
    apart, metrics = _unreached(rec)
    if apart:
        return Check("data", False, apart)
    n = rec.spec.dataset_len
    epochs = [rec.step_meta(0, k).get("epoch") for k in rec.steps]
    given_epochs = all(e is not None for e in epochs)
    src = "the loop's epochs" if given_epochs else f"dataset_len {n}"
    all_exact, reads = True, 0
    cur: dict[str, int] = {}  # id -> step, within the current epoch
    cur_groups: set[tuple[str, ...]] = set()
    cur_reads, epoch, prev = 0, 0, None
    for i, (k, ep) in enumerate(zip(rec.steps, epochs)):
        groups, exact = _reads(rec, k)
        all_exact = all_exact and exact
        same = _identical_ranks(rec, k) if exact else None
        if same:  # ids given: they never overrule the tokens
            return Check("data", False, _identical_words(k, same))
        step_n = sum(len(ids) for _, ids in groups)
        reads += step_n
        if given_epochs:
            if prev is not None and ep != prev:
                cur, cur_groups, cur_reads = {}, set(), 0
            epoch, prev = ep, ep
        elif not n:  # no epochs known: only the step itself is checked
            cur, cur_groups, cur_reads = {}, set(), 0
        elif cur_reads and cur_reads + step_n > n:
            cur, cur_groups, cur_reads, epoch = {}, set(), 0, epoch + 1
        at_end = (epochs[i + 1:i + 2] != [ep] if given_epochs else bool(n) and cur_reads + 2 * step_n > n)
        found = _read_twice(k, groups, exact, cur, cur_groups, epoch, src, rec.spec.reports or at_end)
        if found:
            return Check("data", False, found)
        for r, ids in groups:
            for e in ids:
                cur[e] = (k, r)
            cur_groups.add(tuple(ids))
        cur_reads += step_n
        if given_epochs and n and cur_reads > n:
            return Check("data", False, f"epoch {ep} read {cur_reads} examples by step {k}, more than dataset_len "
                                        f"{n}")
    return Check("data", True, _passed_words(rec, all_exact, unverified, epochs, reads, n) + metrics)
