"""Medians and percentiles of repeated measurements."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Row:
    samples: list[float] = field(default_factory=list)
    unit: str = "ms"
    note: str = ""
    error: str | None = None
    p95: float | None = None  # round trip only: median over batches of each batch's p95

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def to_json(self) -> dict[str, object]:
        return {
            "median": self.median,
            "p95": self.p95,
            "unit": self.unit,
            "n": len(self.samples),
            "min": min(self.samples) if self.samples else None,
            "max": max(self.samples) if self.samples else None,
            "note": self.note,
            "error": self.error,
        }


def summarize(samples: list[float], note: str = "", per_rep: list[list[float]] | None = None) -> Row:
    row = Row(samples=list(samples), note=note)
    if per_rep:
        # The figure is the median of the batches' medians (and of their p95s).
        row.samples = [statistics.median(batch) for batch in per_rep]
        row.p95 = statistics.median(percentile(batch, 0.95) for batch in per_rep)
        row.note = note or f"{len(per_rep)}x{len(per_rep[0])} calls"
    return row
