"""Training: THE loop (loop.train), its fleet (distributed), and `run`, which
trains one RunConfig in one process or as a torchrun fleet (runner.py)."""

from dormouse.train.runner import run

__all__ = ["run"]
