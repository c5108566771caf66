"""report.md, results.csv and the plots."""

import csv
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def write_csv(ctx, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["scenario", "system", "params", "rep", "metric", "value", "unit"])
        w.writeheader()
        for r in ctx.rows:
            w.writerow(r)


def _target_line(t):
    if t["op"] == "is":
        verdict = "met" if t["met"] else "**MISSED**"
        return f"| {t['id']} | {t['what']} | {t['note']} | yes | {verdict} |"
    fig = "n/a" if t["value"] is None else f"{t['value']:.2f}{t['unit']}"
    verdict = "met" if t["met"] else f"**MISSED** ({fig})"
    return f"| {t['id']} | {t['what']} | {fig} | {t['op']} {t['threshold']}{t['unit']} | {verdict} |"


def write_markdown(ctx, path, meta, plots):
    out = [f"# outbox_ext benchmark — {meta['date']}", ""]
    out.append(f"Mode: **{meta['mode']}**; took {meta['elapsed']}. Command: `{meta['command']}`.")
    out.append("")
    out.append(f"- commit: `{meta['commit']}`; outbox_ext {meta['ext_version']} (library {meta['so']}); "
               f"PgQ {meta['pgq_version']}")
    out.append(f"- server: {meta['server_version']}")
    out.append(f"- machine: {meta['machine']}; load average at start {meta['load_start']}, at end {meta['load_end']} "
               "(a shared machine: absolute figures are noisy, ratios within one run are the signal)")
    out.append("- clients: Python psycopg 3 (one process per worker/publisher) and pgbench, over the "
               "cluster's unix socket; every statement is its own transaction unless stated")
    out.append("- the `default` subscription reads the log, as `CREATE EXTENSION` makes it: a publish writes the "
               "log alone")
    out.append("")
    out.append("Medians are over the repetitions shown; every run's value is in `results.csv`.")
    out.append("")
    out.append("## Targets")
    out.append("")
    out.append("| id | what | figure | target | verdict |")
    out.append("|---|---|---|---|---|")
    out.extend(_target_line(t) for t in ctx.targets)
    met = sum(t["met"] for t in ctx.targets)
    out.append("")
    out.append(f"{met} of {len(ctx.targets)} targets met.")
    if ctx.retried:
        out.append("")
        out.append("The extension library was replaced while these scenarios ran; the cluster was restarted "
                   "and they were run again: " + ", ".join(ctx.retried) + ".")
    if ctx.errors:
        out.append("")
        out.append("## Harness errors")
        out.append("")
        for name, err in ctx.errors:
            out.append(f"**{name}**")
            out.append("")
            out.append("```text\n" + err.rstrip() + "\n```")
    out.append("")
    if plots:
        out.append("## Plots")
        out.append("")
        for p in plots:
            out.append(f"![{p}]({p})")
            out.append("")
    out.append("## Server settings")
    out.append("")
    out.append("Every setting not at its built-in default (`pg_settings`, set by the configuration file or the server):")
    out.append("")
    out.append("| name | setting | source |")
    out.append("|---|---|---|")
    for name, setting, unit, source in meta["settings"]:
        out.append(f"| {name} | {setting}{(' ' + unit) if unit else ''} | {source} |")
    out.append("")
    for title, md in ctx.sections:
        out.append(f"## {title}")
        out.append("")
        out.append(md.rstrip())
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def plots(ctx, out_dir):
    made = []
    colors = {"outbox_off": "#9ecae1", "outbox_transaction": "#4292c6", "outbox_background": "#08519c",
              "plain": "#fd8d3c", "plain_notify": "#d94801", "pgq": "#74c476",
              "outbox": "#08519c"}
    s1 = ctx.series.get("s1")
    if s1:
        clients = ctx.p["s1_clients"]
        fig, ax = plt.subplots(figsize=(9, 4.5))
        names = list(s1)
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(clients))]
            ax.bar(xs, [v or 0 for v in s1[n]], width, label=n, color=colors.get(n))
        ax.set_xticks(range(len(clients)))
        ax.set_xticklabels([f"{c} clients" for c in clients])
        ax.set_ylabel("events/s (median)")
        ax.set_title("Publish, one event per transaction")
        ax.legend(fontsize=8, ncol=3)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "publish.png"), dpi=110)
        plt.close(fig)
        made.append("publish.png")
    s3 = ctx.series.get("s3")
    if s3:
        cells = list(s3)
        fig, ax = plt.subplots(figsize=(9, 4.5))
        systems = ["outbox", "plain", "pgq"]
        width = 0.8 / len(systems)
        for i, n in enumerate(systems):
            xs = [c + (i - 1) * width for c in range(len(cells))]
            ax.bar(xs, [s3[k][n] or 0 for k in cells], width, color=colors.get(n),
                   label=n if n != "pgq" else "pgq (1 consumer, log)")
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{w} workers\nbatch {b}" for w, b in cells])
        ax.set_ylabel("events/s (median)")
        ax.set_title(f"Drain a backlog of {ctx.p['drain_n']:,} events")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "drain.png"), dpi=110)
        plt.close(fig)
        made.append("drain.png")
    s4 = ctx.series.get("s4")
    if s4:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for (name, rate), series in sorted(s4.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            ax.plot([t for t, _ in series], [b for _, b in series], label=f"{name} @ {rate:,}/s", linewidth=1.2)
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("backlog (committed, not yet acked)")
        ax.set_title("End to end: backlog over time (median run)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "e2e_backlog.png"), dpi=110)
        plt.close(fig)
        made.append("e2e_backlog.png")
    return made
