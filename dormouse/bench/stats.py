"""Ratios taken round by round, summarised: their median and spread."""

from __future__ import annotations

import statistics


def ratio_summary(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
