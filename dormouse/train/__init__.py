"""Training: THE loop (loop.train), its fleet (distributed), and `run`, which
trains one RunConfig in one process or as a torchrun fleet (runner.py).

`run` (and torch with it) is imported on first use: the fleet's plan
(plan.py) is plain arithmetic that a launcher validates before torch."""

__all__ = ["run"]


def __getattr__(name: str):
    if name == "run":
        from dormouse.train.runner import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
