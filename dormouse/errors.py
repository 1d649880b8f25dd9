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
