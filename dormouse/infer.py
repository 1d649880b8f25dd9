"""Using a trained model: load it from any checkpoint, sample text, measure its
loss on a file.

    model, run, step = load_trained("artifacts/run/dormouse.pt")
    text = generate(model, b"def ", tokens=200, temperature=0.8, top_k=40, seed=0)
    nats, count = file_loss(model, "held_out.txt", seq_len=run.train.seq_len)

Generation continues the prompt's last max_seq_len bytes. The prompt goes
through the forward once, filling a KV cache (one entry per iteration of the
shared block); then each byte costs one position's step of
dormouse.model.decode.Decoder (the same function with fewer, larger tensor
operations), before and after the text outgrows the window: the cache is a ring
of max_seq_len positions, and every position attends to the window ending at it
(sliding-window attention, at every iteration; see DormouseModel.forward,
sliding=True). use_cache=False recomputes that same function over the whole
text at every byte (the reference; slow): the bytes are the same.
generate_many draws several continuations as one batch: a step of B rows reads
the weights once for all of them, which is where a CPU's time goes at B = 1.

Past the window this is not what the generator did before (it recomputed the
last max_seq_len bytes as a fresh window, positions from 0, every byte): with a
looped block a position's deeper iterations carry what its own window saw, so
the two differ once the first byte leaves the window. Within the window they
are the same computation. A capacity-dropping MoE, whose output depends on the
whole batch, has no cache and keeps the fresh-window recompute.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from dormouse.config import RunConfig
from dormouse.errors import ConfigError
from dormouse.model import DormouseModel
from dormouse.model.decode import Decoder
from dormouse.train.checkpoint import load_model_weights
from dormouse.train.data import ByteCorpus, _windows


def load_trained(path: str | Path) -> tuple[DormouseModel, RunConfig, int]:
    """The model a checkpoint holds (a .pt file of any run, or a sharded .dcp
    directory), in eval mode on the CPU; with its RunConfig and step count."""
    model, run, step = load_model_weights(Path(path), build=_build)
    return model.eval(), run, step


def _build(run: RunConfig) -> DormouseModel:
    model = DormouseModel(run.model)
    return model.to(torch.bfloat16) if run.model.bf16 else model


def cached_generation_ok(model: DormouseModel) -> bool:
    """Whether a KV cache gives the uncached result (not under a capacity-dropping MoE)."""
    return not (model.cfg.n_experts > 0 and model.cfg.moe_capacity > 0)


def generate(model: DormouseModel, prompt: bytes, *, tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, use_cache: bool = True) -> bytes:
    """`tokens` bytes continuing `prompt` (the prompt is not included).

    temperature 0 is greedy (argmax); otherwise each byte is drawn from
    softmax(logits / temperature), restricted to the top_k most likely (0 = all),
    by a generator seeded with `seed`: the same arguments give the same bytes."""
    return generate_many(model, prompt, samples=1, tokens=tokens, temperature=temperature, top_k=top_k,
                         seed=seed, use_cache=use_cache)[0]


@torch.inference_mode()
def generate_many(model: DormouseModel, prompt: bytes, *, samples: int, tokens: int, temperature: float = 1.0,
                  top_k: int = 0, seed: int = 0, use_cache: bool = True) -> list[bytes]:
    """`samples` continuations of `prompt`, `tokens` bytes each, generated as
    one batch (each row its own text; one step of the batch reads the weights
    once for all of them). Greedy rows all equal generate()'s greedy bytes;
    sampled rows are drawn together, row by row, from one generator seeded with
    `seed`, so they depend on `samples` (samples=1 is generate())."""
    if not prompt:
        raise ConfigError("the prompt is empty: give at least one byte of text to continue")
    if temperature < 0 or not math.isfinite(temperature):
        raise ConfigError(f"temperature = {temperature} must be a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise ConfigError(f"top_k = {top_k} must be >= 0 (0 = no limit)")
    if samples < 1:
        raise ConfigError(f"samples = {samples} must be >= 1")
    model.eval()
    window = model.cfg.max_seq_len
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(samples, tokens, dtype=torch.int64, device=device)
    # The context: the prompt's last window, then what we generate (one row per sample).
    text = torch.tensor([list(prompt[-window:])], device=device).expand(samples, -1)
    if not cached_generation_ok(model):  # each row's window afresh at every byte (its drops are its own)
        for i in range(tokens):
            logits = torch.cat([model(row[None, -window:])[0][:, -1] for row in text])
            out[:, i] = _pick(logits.float(), temperature, top_k, gen)
            text = torch.cat([text, out[:, i:i + 1]], dim=1)
        return [bytes(row.tolist()) for row in out]
    if use_cache:  # the prompt through the forward once, then one position a step
        cache = model.new_cache()
        logits = model(text[:1], cache=cache)[0][:, -1].expand(samples, -1)
        cache.expand(samples)
        decoder = Decoder(model)
    for i in range(tokens):
        if not use_cache:  # the reference: the same function of the whole text, recomputed
            logits = model(text, sliding=True)[0][:, -1]
        nxt = _pick(logits.float(), temperature, top_k, gen)
        out[:, i] = nxt
        if use_cache:
            if i + 1 < tokens:
                logits = decoder.step(nxt, cache)
        else:
            text = torch.cat([text, nxt[:, None]], dim=1)
    return [bytes(row.tolist()) for row in out]


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """The next byte of each row of logits (B, vocab): (B,) ids."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        cut = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)[:, 0]


@torch.no_grad()
def file_loss(model: DormouseModel, path: str | Path, *, seq_len: int, batch: int = 16,
              tail_frac: float = 0.0) -> tuple[float, int]:
    """Mean next-byte loss in nats over a file, and the number of bytes predicted.

    The file (or, with tail_frac > 0, its last tail_frac, the held-out tail a
    run with eval_frac = tail_frac never trains on) is cut into consecutive
    windows of seq_len + 1 bytes; every window predicts its last seq_len bytes
    from the ones before them. A remainder shorter than one window is not scored."""
    model.eval()
    corpus = ByteCorpus(path, tail_frac)
    start = corpus.train_bytes if tail_frac else 0
    size = corpus.eval_bytes if tail_frac else corpus.train_bytes
    n = size // (seq_len + 1)
    if n == 0:
        part = "its held-out tail" if tail_frac else "it"
        raise ConfigError(
            f"{str(path)!r}: {part} holds {size} bytes, fewer than one window of {seq_len + 1}: "
            "use a longer file or a shorter window"
        )
    device = next(model.parameters()).device
    total = 0.0
    for first in range(0, n, batch):
        count = min(batch, n - first)
        raw = np.asarray(corpus.bytes[start + first * (seq_len + 1): start + (first + count) * (seq_len + 1)])
        x, y = _windows(raw, count, seq_len)
        _, loss, _ = model(x.to(device), y.to(device))
        total += float(loss) * y.numel()
    return total / (n * seq_len), n * seq_len


def sample_text(ckpt: str | Path, prompt: str, *, tokens: int, temperature: float = 1.0, top_k: int = 0,
                seed: int = 0, use_cache: bool = True, samples: int = 1) -> str:
    """`dormouse sample`: the continuation of `prompt` (UTF-8 bytes) by the
    checkpoint's model, decoded as UTF-8 (invalid sequences replaced); with
    samples > 1, that many continuations drawn as one batch (generate_many),
    each under a line `--- sample i ---`."""
    model, _, _ = load_trained(ckpt)
    outs = generate_many(model, prompt.encode(), samples=samples, tokens=tokens, temperature=temperature,
                         top_k=top_k, seed=seed, use_cache=use_cache)
    texts = [out.decode("utf-8", errors="replace") for out in outs]
    if samples == 1:
        return texts[0]
    return "\n".join(f"--- sample {i} ---\n{t}" for i, t in enumerate(texts))


def score_file(ckpt: str | Path, data: str | Path, *, part: str = "whole", seq_len: int | None = None,
               batch: int = 16) -> str:
    """`dormouse eval`: one line with the mean next-byte loss over `data` in
    nats and in bits per byte (bits = nats / ln 2), over the whole file or
    (part="tail") the last train.eval_frac the checkpoint's run held out."""
    model, run, step = load_trained(ckpt)
    seq_len = seq_len or run.train.seq_len
    if seq_len > run.model.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_seq_len {run.model.max_seq_len}")
    tail = 0.0
    if part == "tail":
        tail = run.train.eval_frac
        if not tail:
            raise ConfigError("--part tail: the checkpoint's run held nothing out (train.eval_frac = 0); "
                              "score the whole file instead")
    nats, count = file_loss(model, data, seq_len=seq_len, batch=batch, tail_frac=tail)
    where = "whole file" if part == "whole" else f"last {tail:g} of the file"
    return (f"loss {nats:.6f} nats/byte, {nats / math.log(2):.6f} bits/byte over {count:,} bytes of "
            f"{data} ({where}, windows of {seq_len}; checkpoint at step {step})")
