"""The scale scripts' data: random token rows, the same in every process that asks for them."""

import torch


def token_rows(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """n rows of random tokens 1..vocab-1, of lengths seq/2..seq, right-padded with 0 (labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(seq // 2, seq + 1, (1,), generator=g))
        ids = torch.zeros(seq, dtype=torch.long)
        ids[:length] = torch.randint(1, vocab, (length,), generator=g)
        mask = (torch.arange(seq) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows
