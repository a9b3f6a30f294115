"""`simulate --plot`: hit rate and p99 TTFT against capacity, a line per policy."""

from __future__ import annotations

from pathlib import Path

GiB = 2**30


def size_label(nbytes: int | None) -> str:
    """`4GiB`, `512MiB`, `∞` for no bound."""
    if nbytes is None:
        return "∞"
    for unit, size in (("GiB", GiB), ("MiB", 2**20)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"


def plot_lines(cells: list[dict]) -> tuple[str, dict[str, list[tuple[float, dict]]]]:
    """One workload's runs as (x-axis label, {line label: [(x, policy entry)] by x}). x is the gpu
    slots, or the cpu cache when only it varies; when both vary there is a line per policy and cpu
    size, so that points of different cpu sizes are never joined along the slots axis."""
    slots_vary = len({r["gpu_slots"] for r in cells}) > 1
    cpu_vary = len({r["cpu_bytes"] for r in cells}) > 1
    by_slots = slots_vary or not cpu_vary
    lines: dict[str, list[tuple[float, dict]]] = {}
    for policy in cells[0]["policies"]:
        for r in cells:
            x = r["gpu_slots"] if by_slots else r["cpu_bytes"] / GiB
            label = (
                f"{policy}, cpu {size_label(r['cpu_bytes'])}" if by_slots and cpu_vary else policy
            )
            lines.setdefault(label, []).append((x, r["policies"][policy]))
    for points in lines.values():
        # by x only: the entries are dicts, which do not compare
        points.sort(key=lambda point: point[0])
    return ("gpu slots" if by_slots else "cpu cache (GiB)"), lines


def plot_capacity(runs: list[dict], path: Path) -> None:
    """gpu hit rate, p99 TTFT and hot adapters' p99 TTFT against capacity, lines as `plot_lines`
    draws them, a row per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in runs))
    panels = (
        ("gpu hit rate", lambda e: e["hit_rate"]["gpu"]),
        ("p99 TTFT, all (ms)", lambda e: (e["latency"]["all"]["ttft_s"]["p99"] or 0) * 1000),
        (
            "p99 TTFT, hot adapters (ms)",
            lambda e: (e["latency"]["hot"]["ttft_s"]["p99"] or 0) * 1000,
        ),
    )
    fig, axes = plt.subplots(len(names), len(panels), figsize=(15, 3.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        xlabel, lines = plot_lines([r for r in runs if r["workload"] == name])
        for label, points in lines.items():
            oracle = label.startswith(("optimal", "a0"))
            style = {"marker": "o", "linestyle": "--" if oracle else "-", "label": label}
            for ax, (_, value) in zip(axes[row], panels):
                ax.plot([x for x, _ in points], [value(e) for _, e in points], **style)
        for ax, (label, _) in zip(axes[row], panels):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.set_title(name)
            ax.set_xticks(sorted({x for points in lines.values() for x, _ in points}))
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=8)
    fig.suptitle(
        "optimal: the farthest-next-use oracle run; a0: the true-popularity oracle", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
