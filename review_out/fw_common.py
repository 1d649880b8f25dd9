"""Shared by the framework clients: a labelled dataset of equal-length rows and a model whose
forward takes (input_ids, labels) the HF way (labels ignored by the forward: the loss is the loop's)."""
import torch

import common


class LabelLM(common.TinyLM):
    def forward(self, input_ids, labels=None):
        return super().forward(input_ids)


def build_net(**_):
    torch.manual_seed(0)
    m = LabelLM(64)
    return m


def build_optimizer(model, **_):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


class Rows(torch.utils.data.Dataset):
    """n rows of T tokens, labels = input_ids (every row T-1 targets after the shift)."""
    def __init__(self, n=16):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randint(0, 64, (n, common.T), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i].clone()}


class Saver:
    """The client's own record of what the fleet did (independent of the gate): each rank's
    micro-batches, its parameters before the step and the gradient the optimizer applies."""
    def __init__(self, out, rank, model):
        import os
        self.out, self.rank, self.model, self.batches, self.k = f"{out}_truth", rank, model, [], 0
        os.makedirs(self.out, exist_ok=True)
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, mod, args, kwargs):
        if mod.training and torch.is_grad_enabled():
            x = kwargs.get("input_ids", args[0] if args else None)
            self.batches.append({"input_ids": x.detach().clone(), "labels": kwargs["labels"].detach().clone()})

    def step(self, loss):
        self.k += 1
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        torch.save({"params": self.params, "grads": grads, "loss": float(loss), "batches": self.batches},
                   f"{self.out}/rank{self.rank}_step{self.k}.pt")
        self.batches = []

    def after(self):
        self.params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
