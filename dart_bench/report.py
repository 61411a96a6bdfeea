"""The report of `dart-spec bench`: results.json, a markdown table and two charts, each file replaced atomically."""

from __future__ import annotations

from pathlib import Path

from dart_bench.results import save_png, write_results, write_text


def markdown_table(summary: list[dict]) -> str:
    """The summary as one markdown table per temperature."""
    out = []
    for temperature in sorted({r["temperature"] for r in summary}):
        out.append(f"**temperature {temperature:g}**\n")
        out.append("| set | method | tok/s | speedup (median, range) | tau | draft ms/step | tree ms/step | "
                   "verify ms/step | other ms/step | identical |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in summary:
            if r["temperature"] != temperature:
                continue
            s = r["speedup"]
            ident = f"{100 * r['identical']:.0f}%" if "identical" in r else "-"
            out.append(f"| {r['set']} | {r['method']} | {r['tokens_per_s']['median']:.1f} | "
                       f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}) | {r['tau']:.2f} | "
                       f"{r['draft_ms_per_step']:.1f} | {r['tree_ms_per_step']:.1f} | {r['verify_ms_per_step']:.1f} | "
                       f"{r['other_ms_per_step']:.1f} | {ident} |")
        out.append("")
    return "\n".join(out)


def write_charts(summary: list[dict], out_dir: str | Path) -> list[Path]:
    """speedup.png (speedup per set and method, one panel per temperature) and breakdown.png (ms per verify step
    by phase, all sets pooled, with tau); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    temperatures = sorted({r["temperature"] for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in summary))
    sets = list(dict.fromkeys(r["set"] for r in summary))
    paths = []

    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), squeeze=False)
    width = 0.8 / len(methods)
    for ax, temperature in zip(axes[0], temperatures):
        for m, method in enumerate(methods):
            values = [next((r["speedup"]["median"] for r in summary if r["temperature"] == temperature
                            and r["set"] == s and r["method"] == method), 0.0) for s in sets]
            ax.bar([i + m * width for i in range(len(sets))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        top = max([r["speedup"]["median"] for r in summary if r["temperature"] == temperature] + [1.0])
        ax.set_ylim(0, top * 1.15)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(sets))], sets)
        ax.set_ylabel("speedup over plain generate()")
        ax.set_title(f"temperature {temperature:g}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(save_png(fig, out_dir / "speedup.png"))
    plt.close(fig)

    phases = ("draft_ms_per_step", "tree_ms_per_step", "verify_ms_per_step", "other_ms_per_step")
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 3.5), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        rows = [next(r for r in summary if r["temperature"] == temperature and r["set"] == "all"
                     and r["method"] == method) for method in methods]
        left = [0.0] * len(rows)
        for phase in phases:
            values = [r[phase] for r in rows]
            ax.barh(methods, values, left=left, label=phase.replace("_ms_per_step", ""))
            left = [a + b for a, b in zip(left, values)]
        for i, r in enumerate(rows):
            ax.text(left[i], i, f"  tau {r['tau']:.2f}", va="center", fontsize=8)
        ax.set_xlabel("ms per verify step (all sets)")
        ax.set_title(f"temperature {temperature:g}")
        ax.set_xlim(0, max(left) * 1.3)
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    paths.append(save_png(fig, out_dir / "breakdown.png"))
    plt.close(fig)
    return paths


def write_report(results: dict, out_dir: str | Path, charts: bool = True) -> list[Path]:
    """results.json, table.md and (with matplotlib) the charts into `out_dir`, each file replaced atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_results(out_dir / "results.json", results, indent=1)
    write_text(out_dir / "table.md", markdown_table(results["summary"]))
    paths = [out_dir / "results.json", out_dir / "table.md"]
    if charts:
        paths += write_charts(results["summary"], out_dir)
    return paths
