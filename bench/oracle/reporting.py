"""Reporting of the oracle's table (simulate.run): a markdown summary and the speedup plot."""
from __future__ import annotations

from pathlib import Path

from ..costmodel import CostModel


def summary_markdown(df, cost: CostModel) -> str:
    mode = df.batch_mode.iloc[0] if len(df) else "set"
    how = ("one request repeated B times (the published methodology); speedup = mean speculative throughput / mean "
           "baseline throughput over the sampled requests" if mode == "repeat" else
           "B different requests, rows leaving as they finish, each step waiting for its slowest drafter; speedup = "
           "total speculative throughput / total baseline throughput")
    lines = [f"# Oracle analysis ({cost.name})", "", f"Cost model: {cost.source or cost.name}.", "",
             f"Batches: {how}. Single-method policies are charged the same in both accountings.", ""]
    every_half = df  # under --tune the dp table shows each half too
    if "half" in df and (df.half == "both").any():
        lines += ["Tuned (--tune), cross-fitted: the sampled requests split in two halves, a policy's parameters "
                  "fitted on each half and scored on the other, so every request is scored by parameters fitted "
                  "without it. The tables hold every sampled request (half = both; a policy shows the spec fitted "
                  "for each half, 'A / B', where the two fits differ); the dp table also each half alone.", ""]
        df = df[df.half == "both"]
    charges = df.neural_draft_charge.unique() if "neural_draft_charge" in df else [None]
    for (ds, charge), g in df.groupby(["dataset", "neural_draft_charge"] if len(charges) > 1 else
                                      ["dataset", df.dataset.map(lambda _: None)], dropna=False):
        piv = g.pivot_table(index=["policy", "accounting"], columns="batch_size", values="speedup")
        title = ds if len(charges) == 1 else f"{ds} (neural drafts charged per {charge})"
        lines += [f"## {title}", "", "| policy | accounting | " + " | ".join(f"B={b}" for b in piv.columns) + " |",
                  "|---|---|" + "---|" * len(piv.columns)]
        for (pol, acc), r in piv.iterrows():
            lines.append(f"| {pol} | {acc} | " + " | ".join(f"{v:.2f}" for v in r.values) + " |")
        b1 = g[g.batch_size == g.batch_size.min()]
        comb = b1[(b1.kind == "combined") & (b1.accounting == "optimistic")]
        faith = b1[(b1.kind == "combined") & (b1.accounting == "faithful")]
        oracle1 = b1[b1.kind == "oracle"]
        fixed1 = b1[b1.kind == "fixed"]
        real = b1[(b1.kind == "fallback") & (b1.accounting == (faith.accounting.iloc[0] if len(faith) else "optimistic"))]
        if len(comb) and len(fixed1):
            best_fixed = fixed1.loc[fixed1.speedup.idxmax()]
            opt = comb.speedup.max()
            ork = f"; best single-method oracle-k {oracle1.speedup.max():.2f}x" if len(oracle1) else ""
            lines += ["", f"At B={int(g.batch_size.min())}: best realizable single method {best_fixed.policy} "
                      f"{best_fixed.speedup:.2f}x{ork}; combined oracle "
                      f"{opt:.2f}x optimistic" + (f", {faith.speedup.max():.2f}x faithful" if len(faith) else "") + "."]
            if len(real):
                best_real = real.loc[real.speedup.idxmax()]
                r = best_real.speedup
                gap = opt - best_fixed.speedup
                if gap < 0.05:
                    lines.append(f"The realizable rule {best_real.policy} reaches {r:.2f}x; the combined bound is within "
                                 f"{gap:.2f}x of {best_fixed.policy}, so there is little gap to close.")
                elif r < best_fixed.speedup:
                    lines.append(f"The best realizable rule, {best_real.policy}, reaches {r:.2f}x: below {best_fixed.policy} "
                                 "alone, so it closes none of the gap to the combined bound.")
                else:
                    lines.append(f"The realizable rule {best_real.policy} reaches {r:.2f}x: it closes "
                                 f"{100 * (r - best_fixed.speedup) / gap:.0f}% of the gap between {best_fixed.policy} and the "
                                 "optimistic combined bound.")
        same = (every_half.dataset == ds) & ((every_half.neural_draft_charge == charge) if len(charges) > 1 else True)
        lines += _against_dp(every_half[same])
        lines.append("")
    return "\n".join(lines)


def _against_dp(g) -> list[str]:
    """The realizable policies against the dp bound: speedup and gap_closed per batch size and
    accounting (gap_closed = (policy - best fixed) / (dp - best fixed)); under --tune per half
    scored too (both first, then each half alone)."""
    if "gap_closed" not in g or not (g.kind == "dp").any():
        return []
    # a tuned policy is shown under the spec it was tuned from, its fitted spec in its cell
    label = g.tuned_from.fillna(g.policy) if "tuned_from" in g else g.policy
    half = g.half if "half" in g else g.policy.map(lambda _: "all")
    recs = g.assign(label=label, half=half)[["batch_size", "accounting", "half", "label", "kind", "policy",
                                             "speedup", "gap_closed", "realizable"]].to_dict("records")
    pols = sorted({r["label"] for r in recs if r["realizable"] and r["kind"] not in ("fixed", "dp")})
    order = {"all": 0, "both": 0, "first": 1, "second": 2}
    groups: dict[tuple, list[dict]] = {}
    for r in recs:  # rows in the table's order within each group
        groups.setdefault((r["batch_size"], r["accounting"], r["half"]), []).append(r)
    scored = len({k[2] for k in groups}) > 1  # --tune: every request (both), then each half alone
    lines = ["", "Realizable policies against the dp bound (speedup, gap_closed = (policy - best fixed) / "
             "(dp - best fixed); dp above batch 1 is approximate, marked ~):", "",
             "| batch | accounting | " + ("scored | " if scored else "") + "best fixed | dp | " + " | ".join(pols) + " |",
             "|---|---|" + ("---|" if scored else "") + "---|---|" + "---|" * len(pols)]
    for (b, acc, h) in sorted(groups, key=lambda k: (k[0], k[1], order.get(k[2], 3))):
        rows = groups[(b, acc, h)]
        fixed = [r for r in rows if r["kind"] == "fixed"]
        top = max(fixed, key=lambda r: r["speedup"]) if fixed else None  # the first of equals, as idxmax
        best = f"{top['policy']} {top['speedup']:.2f}" if top else "-"
        dp = max((r["speedup"] for r in rows if r["kind"] == "dp"), default=float("nan"))
        first = {}
        for r in rows:
            first.setdefault(r["label"], r)
        cells = []
        for p in pols:
            r = first.get(p)
            fitted = f" {r['policy']}" if r and r["policy"] != p else ""
            cells.append("n/a" if r is None else f"{r['speedup']:.2f} ({r['gap_closed']:+.2f}){fitted}")
        lines.append(f"| {b} | {acc} | " + (f"{h} | " if scored else "") + f"{best} | {dp:.2f}{'~' if b > 1 else ''} | "
                     + " | ".join(cells) + " |")
    return lines


def plot(df, out: Path) -> Path:
    import matplotlib.pyplot as plt

    from ..plotting import save  # sets the Agg backend

    dss = sorted(df.dataset.unique())
    fig, axes = plt.subplots(1, len(dss), figsize=(4.6 * len(dss), 3.8), squeeze=False, sharey=True)
    for ax, ds in zip(axes[0], dss):
        g = df[(df.dataset == ds) & df.kind.isin(["oracle", "combined", "fallback"])]
        for (pol, acc), h in g.groupby(["policy", "accounting"]):
            if h.kind.iloc[0] == "oracle" and acc != g.accounting.iloc[0]:
                continue
            h = h.sort_values("batch_size")
            ax.plot(h.batch_size, h.speedup, marker="o", ls="--" if acc == "faithful" else "-",
                    label=f"{pol}" + (f" ({acc})" if h.kind.iloc[0] != "oracle" else ""))
        ax.axhline(1, color="grey", lw=0.8)
        ax.set(title=ds, xscale="log", xlabel="batch size")
    axes[0][0].set_ylabel("simulated speedup")
    axes[0][-1].legend(fontsize=6)
    return save(fig, out, "oracle_speedup")
