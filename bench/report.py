"""Turn target results into the Markdown report, the ratios lmserve / peer, and a PNG plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from bench.metrics import LevelResult
from bench.targets import TargetResult


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.0f}"


def _level(result: TargetResult, concurrency: int) -> LevelResult | None:
    return next((lv for lv in result.levels if lv.concurrency == concurrency), None)


def results_table(results: list[TargetResult]) -> str:
    """One row per target and level; one row saying why for a target that did not run."""
    head = ("| target | streams | ok / failed | output tok/s | tok/request | TTFT p50 ms | TTFT p95 ms "
            "| ITL p50 ms | ITL p95 ms | wall s |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    rows = [head]
    for r in results:
        if r.status != "ok" or not r.levels:
            reason = (r.reason or "").splitlines()[0] if r.reason else ""
            rows.append(f"| {r.name} | {r.status} ({reason}) | | | | | | | | |")
            continue
        for lv in r.levels:
            tpr = ("–" if lv.tokens_per_request is None
                   else f"{lv.tokens_per_request:.0f}" + ("*" if lv.tokens_counted else ""))
            rows.append(f"| {r.name} | {lv.concurrency} | {lv.ok} / {lv.failed} | {lv.tokens_per_s:.1f} | {tpr} | "
                        f"{_ms(lv.ttft_p50)} | {_ms(lv.ttft_p95)} | {_ms(lv.itl_p50)} | {_ms(lv.itl_p95)} | "
                        f"{lv.wall_s:.1f} |")
    return "\n".join(rows)


def ratio_rows(results: list[TargetResult], levels: list[int]) -> list[tuple[str, list[str], str]]:
    """(comparison, value per level, lmserve's target (docs/performance.md) and whether this run met it)."""
    by_name = {r.name: r for r in results if r.status == "ok"}

    def tps_ratio(a: str, b: str) -> list[float | None]:
        out = []
        for c in levels:
            la = _level(by_name[a], c) if a in by_name else None
            lb = _level(by_name[b], c) if b in by_name else None
            out.append(la.tokens_per_s / lb.tokens_per_s if la and lb and lb.tokens_per_s > 0 else None)
        return out

    def fmt(values: list[float | None], unit: str = "×") -> list[str]:
        return ["–" if v is None else (f"{v:.2f}{unit}" if unit == "×" else f"{v:+.1f} {unit}") for v in values]

    def verdict(value: float | None, ok: bool) -> str:
        return "not measured" if value is None else ("met" if ok else "not met")

    rows = []
    vs_lf = tps_ratio("lmserve-hf", "llamafactory")
    at16 = vs_lf[levels.index(16)] if 16 in levels else None
    rows.append(("tok/s lmserve-hf / llamafactory", fmt(vs_lf),
                 f"≥ 8× at 16 streams: {verdict(at16, at16 is not None and at16 >= 8)}"))
    vs_ip = tps_ratio("lmserve-hf", "inprocess-hf")
    at1 = vs_ip[levels.index(1)] if 1 in levels else None
    rows.append(("tok/s lmserve-hf / inprocess-hf", fmt(vs_ip),
                 f"≥ 0.9× at 1 stream: {verdict(at1, at1 is not None and at1 >= 0.9)}"))
    overhead = []
    for c in levels:
        la = _level(by_name["lmserve-hf"], c) if "lmserve-hf" in by_name else None
        lb = _level(by_name["inprocess-hf"], c) if "inprocess-hf" in by_name else None
        ok = la and lb and la.ttft_p50 is not None and lb.ttft_p50 is not None
        overhead.append((la.ttft_p50 - lb.ttft_p50) * 1000 if ok else None)
    o1 = overhead[levels.index(1)] if 1 in levels else None
    rows.append(("TTFT p50 lmserve-hf − inprocess-hf", fmt(overhead, "ms"),
                 f"≤ 5 ms at 1 stream: {verdict(o1, o1 is not None and o1 <= 5)}"))
    vs_vllm = tps_ratio("lmserve-vllm", "vllm-serve")
    measured = [v for v in vs_vllm if v is not None]
    all_met = len(measured) == len(levels) and min(measured) >= 0.9
    rows.append(("tok/s lmserve-vllm / vllm-serve", fmt(vs_vllm),
                 f"≥ 0.9× at every level: {verdict(measured[0] if measured else None, all_met)}"))
    return rows


def ratios_table(results: list[TargetResult], levels: list[int]) -> str:
    head = "| comparison | " + " | ".join(f"{c} stream{'s' if c > 1 else ''}" for c in levels) + " | target |"
    sep = "|---|" + "--:|" * len(levels) + "---|"
    return "\n".join([head, sep] + [f"| {name} | " + " | ".join(vals) + f" | {target} |"
                                    for name, vals, target in ratio_rows(results, levels)])


def markdown(results: list[TargetResult], levels: list[int], header: str, notes: list[str]) -> str:
    parts = [header, "", results_table(results), "",
             "lmserve / peer (ratios of output tokens/s; TTFT difference in ms):",
             "", ratios_table(results, levels), "", "Targets:", ""]
    for r in results:
        line = f"- `{r.name}`: {r.description}" if r.description else f"- `{r.name}`:"
        if r.startup_s is not None:
            line += f"; ready {r.startup_s:.1f} s after start"
        if r.load_at_start and r.status == "ok":
            line += f"; load average {r.load_at_start} as it started (the previous target's own load fades slowly)"
        if r.status != "ok":
            line += f"{'.' if r.description else ''} {r.status}" + (f": {r.reason.splitlines()[0]}" if r.reason else "")
        elif r.reason:
            line += f". {r.reason}"
        parts.append(line)
    errors = [(r.name, lv.concurrency, e) for r in results for lv in r.levels for e in lv.errors]
    if errors:
        parts += ["", "Failures (first messages):", ""] + [f"- `{n}` at {c}: {e}" for n, c, e in errors]
    parts += ["", *notes]
    return "\n".join(parts) + "\n"


# One colour per target, the same in every run; peers dashed.
_COLORS = {"lmserve-hf": "tab:blue", "inprocess-hf": "tab:cyan", "llamafactory": "tab:orange",
           "lmserve-vllm": "tab:green", "inprocess-vllm": "tab:olive", "vllm-serve": "tab:red"}


def plot(results: list[TargetResult], path: Path, title: str) -> Path | None:
    """Output tokens/s and TTFT p50 against concurrency, one line per target; None without
    matplotlib (install the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        if r.status != "ok" or not r.levels:
            continue
        style = {"marker": "o", "label": r.name, "color": _COLORS.get(r.name),
                 "linestyle": "--" if r.name.startswith(("llamafactory", "vllm-serve")) else "-"}
        ax1.plot([lv.concurrency for lv in r.levels], [lv.tokens_per_s for lv in r.levels], **style)
        pts = [(lv.concurrency, lv.ttft_p50 * 1000) for lv in r.levels if lv.ttft_p50 is not None]
        if pts:
            ax2.plot(*zip(*pts), **style)
    levels = sorted({lv.concurrency for r in results for lv in r.levels})
    for ax, ylabel in ((ax1, "output tokens/s (aggregate)"), (ax2, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def as_json(results: list[TargetResult]) -> list[dict]:
    return [asdict(r) for r in results]
