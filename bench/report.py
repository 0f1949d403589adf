"""The one table: figures per system, ratios against ipybox and the floor, targets met or missed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stats import Row

Results = dict[str, dict[str, Row]]  # system key -> row key -> Row
COLUMNS = [
    ("ipyfence", "ipyfence"),
    ("nosandbox", "--no-sandbox"),
    ("srt", "ipyf. srt"),
    ("ipybox", "ipybox 0.9.2"),
    ("floor", "floor"),
    ("baseline", "baseline"),
]
METRICS = [
    ("cold_start", "cold start: spawn→init→1st cell", "ms"),
    ("kernel_start", "fresh kernel (reset, --no-standby)", "ms"),
    ("round_trip", "1+1 round trip, median", "ms"),
    ("round_trip.p95", "1+1 round trip, p95", "ms"),
    ("big_output", "cell printing 1 MB", "ms"),
    ("reset", "reset() + first cell", "ms"),
    ("register", "register_mcp_server(everything)", "ms"),
    ("tool_call", "tool call from code, per call", "ms"),
    ("install", "install_package, cached wheel", "ms"),
    ("rss", "peak RSS, server + kernels", "MB"),
]


@dataclass
class Target:
    metric: str  # the row it is printed on
    text: str
    check: Callable[[Results], tuple[float | None, bool | None, str]]  # (value, met, shown)


def value(results: Results, system: str, metric: str) -> float | None:
    key, _, sub = metric.partition(".")
    row = results.get(system, {}).get(key)
    if row is None or row.error:
        return None
    return row.p95 if sub == "p95" else row.median


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _targets() -> list[Target]:
    def overhead_rt(r: Results) -> tuple[float | None, bool | None, str]:
        x = _ratio(value(r, "ipyfence", "round_trip"), value(r, "nosandbox", "round_trip"))
        return (None, None, "") if x is None else (x, (x - 1) <= 0.05, f"{(x - 1) * 100:+.1f}% vs --no-sandbox")

    def overhead_cold(r: Results) -> tuple[float | None, bool | None, str]:
        a, b = value(r, "ipyfence", "cold_start"), value(r, "nosandbox", "cold_start")
        if a is None or b is None:
            return None, None, ""
        return a - b, (a - b) <= 50, f"{a - b:+.0f} ms vs --no-sandbox"

    def faster_than_ipybox(r: Results) -> tuple[float | None, bool | None, str]:
        x = _ratio(value(r, "ipybox", "cold_start"), value(r, "ipyfence", "cold_start"))
        return (None, None, "ipybox n/a") if x is None else (x, x >= 4, f"{x:.1f}× faster")

    def absolute(metric: str, limit: float, unit: str) -> Callable[[Results], tuple[float | None, bool | None, str]]:
        def check(r: Results) -> tuple[float | None, bool | None, str]:
            v = value(r, "ipyfence", metric)
            return (None, None, "") if v is None else (v, v <= limit, f"{v:.2f} {unit}")

        return check

    def rt_floor(r: Results) -> tuple[float | None, bool | None, str]:
        x = _ratio(value(r, "ipyfence", "round_trip"), value(r, "floor", "round_trip"))
        return (None, None, "") if x is None else (x, x <= 1.5, f"{x:.2f}× floor")

    def rss(r: Results) -> tuple[float | None, bool | None, str]:
        x = _ratio(value(r, "ipyfence", "rss"), value(r, "ipybox", "rss"))
        return (None, None, "ipybox n/a") if x is None else (x, x <= 1.0, f"{x:.2f}× ipybox")

    return [
        Target("round_trip", "sandbox overhead ≤5%", overhead_rt),
        Target("round_trip", "≤1.5× floor", rt_floor),
        Target("cold_start", "sandbox overhead ≤50 ms", overhead_cold),
        Target("cold_start", "≥4× faster than ipybox", faster_than_ipybox),
        Target("reset", "≤150 ms", absolute("reset", 150, "ms")),
        Target("tool_call", "≤1.5 ms/call", absolute("tool_call", 1.5, "ms")),
        Target("rss", "≤ ipybox", rss),
    ]


def _cell(results: Results, system: str, metric: str, errors: dict[str, str]) -> str:
    sysrows = results.get(system)
    if sysrows is None:
        return "—"
    row = sysrows.get("_error") or sysrows.get(metric.partition(".")[0])
    if row is None:
        return "—"
    if row.error:
        mark = errors.setdefault(row.error, f"[{len(errors) + 1}]")
        return ("unavailable" if "_error" in sysrows else "ERROR") + mark
    v = value(results, system, metric)
    if v is None:
        return "—"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def render(results: Results) -> tuple[str, list[dict[str, object]]]:
    targets = _targets()
    errors: dict[str, str] = {}
    columns = [(key, label) for key, label in COLUMNS if key != "baseline" or key in results]
    header = ["metric", "unit", *[label for _, label in columns], "÷ipybox", "÷floor", "target", "status"]
    lines: list[list[str]] = []
    verdicts: list[dict[str, object]] = []
    for metric, label, unit in METRICS:
        cells = [_cell(results, key, metric, errors) for key, _ in columns]
        ours = value(results, "ipyfence", metric)
        vs_box = _ratio(ours, value(results, "ipybox", metric))
        vs_floor = _ratio(ours, value(results, "floor", metric))
        row_targets = [t for t in targets if t.metric == metric.partition(".")[0] and "." not in metric]
        first = True
        for t in row_targets or [None]:
            if t is None:
                tgt, status = "", ""
            else:
                v, met, shown = t.check(results)
                tgt = t.text
                status = "n/a" if met is None else (f"met ({shown})" if met else f"MISSED ({shown})")
                verdicts.append({"target": t.text, "metric": t.metric, "value": v, "met": met, "shown": shown})
            if first:
                lines.append([label, unit, *cells, _fmt_ratio(vs_box), _fmt_ratio(vs_floor), tgt, status])
                first = False
            else:
                lines.append(["", "", *[""] * len(columns), "", "", tgt, status])
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = [_join(header, widths), _join(["-" * w for w in widths], widths)]
    out += [_join(r, widths) for r in lines]
    out.append("")
    out.append("÷ipybox, ÷floor: ipyfence (bwrap) divided by that column — below 1 means ipyfence is faster/smaller.")
    out.append("—: does not apply or not measured for that system (see bench/README.md).")
    for system, key_rows in results.items():
        for key, row in key_rows.items():
            if row.note.strip() and key in ("big_output", "reset", "rss"):
                out.append(f"note: {system} {key}: {row.note}")
    for msg, mark in errors.items():
        out.append(f"{mark} {msg}")
    return "\n".join(out), verdicts


def _fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}×"


def _join(cells: list[str], widths: list[int]) -> str:
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ).rstrip()
