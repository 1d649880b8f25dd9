"""The value types and the help formatter of dormouse's command-line parsers
(argparse turns a type's ValueError into a one-line usage error: errors.OneLineParser)."""

from __future__ import annotations

import argparse
import math


class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; descriptions keep their line breaks.
    An empty default (a switch that is off, an unset path) is left unsaid: the
    help text says what leaving it out means."""

    def _get_help_string(self, action):
        if action.default in ("", None, False, []):
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse turns the ValueError into a usage error)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value
