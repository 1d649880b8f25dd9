"""The reference's one error: a recording that cannot be rebuilt or judged as it stands."""

from __future__ import annotations

from dormouse.errors import DormouseError


class ReferenceError(DormouseError):
    """The recording cannot be rebuilt or judged as it stands (bad input)."""
