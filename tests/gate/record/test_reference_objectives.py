"""The reference's built-in objectives read the logits wherever a model returns them."""

import torch
import torch.nn.functional as F

from dormouse.gate.record.reference.objective import objective_sum


class TupleLM(torch.nn.Module):
    """transformers' return_dict=False convention: (loss, logits) when given labels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(11, 7)
        self.head = torch.nn.Linear(7, 11)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        if labels is None:
            return (logits,)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
        return loss, logits


def test_a_model_returning_loss_then_logits_is_judged_on_its_logits():
    """A (loss, logits) tuple: the objective is computed from the logits (a review's loop crashed the check
    with an IndexError on the 0-d loss), equal to the test's own token sum."""
    model = TupleLM()
    ids = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    got, count = objective_sum("causal_lm", model, batch)
    logits = model.head(model.emb(ids))
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 11).double(), ids[:, 1:].reshape(-1), reduction="sum")
    assert count == 3 * 5
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
