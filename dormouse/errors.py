"""The errors dormouse raises on purpose.

Every one of them carries a message meant for the person at the keyboard: what
is wrong and what to do. Command-line entry points print that message alone
(no traceback) and exit with status 2, and a notebook shows it alone too
(IPython calls `_render_traceback_`); library callers can catch
`DormouseError` to tell "you asked for something impossible" from a bug.
"""

from __future__ import annotations


class DormouseError(Exception):
    """A problem with the user's input or environment, stated in one message."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a traceback: the message alone."""
        return [f"{type(self).__name__}: {self}"]


class ConfigError(DormouseError, ValueError):
    """A configuration field holds a value dormouse cannot run with."""


class DataError(DormouseError):
    """The corpus is missing, empty, or too short for the requested batch."""


class CheckpointError(DormouseError):
    """A checkpoint cannot be written, read, or does not belong to this run."""


class DivergedError(DormouseError):
    """Training produced a non-finite loss; the last good checkpoint is kept."""


class FleetError(DormouseError):
    """A data-parallel fleet is misconfigured or one of its ranks failed."""


class PlanError(ConfigError, FleetError):
    """The fleet's plan (profile, world, batch, micro-batch) cannot be made.

    `field` names what holds the bad value (profile, micro_batch, world),
    `value` is that value and `reason` says why and what to do, so callers
    that name the setting otherwise (the gate's settings) restate it without
    cutting the message apart."""

    def __init__(self, field: str, value, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field} = {value!r}: {reason}")
