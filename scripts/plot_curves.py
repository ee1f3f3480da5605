#!/usr/bin/env python3
"""Plots two runs' loss curves (metrics.jsonl: training loss as a 20-step mean, eval loss) into one PNG, with the
relative difference below. Usage: plot_curves.py A.jsonl B.jsonl out.png --labels "fp32 state" "bf16 state"
Needs matplotlib (a tool for the docs, not part of deltastack)."""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(p):
    rows = [json.loads(l) for l in open(p)]
    tr = {j["step"]: j["loss"] for j in rows if "loss" in j}
    ev = {j["step"]: j["eval_loss"] for j in rows if "eval_loss" in j}
    return tr, ev


def mean(tr, s, w=20):
    xs = [tr[k] for k in range(s - w + 1, s + 1) if k in tr]
    return sum(xs) / len(xs)


ap = argparse.ArgumentParser()
ap.add_argument("a")
ap.add_argument("b")
ap.add_argument("out")
ap.add_argument("--labels", nargs=2, default=["A", "B"])
ap.add_argument("--title", default="")
o = ap.parse_args()
(ta, ea), (tb, eb) = load(o.a), load(o.b)
steps = sorted(set(ta) & set(tb))
fig, (top, bot) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
for tr, ev, lab, c in ((ta, ea, o.labels[0], "C0"), (tb, eb, o.labels[1], "C1")):
    top.plot(steps, [mean(tr, s) for s in steps], color=c, label=f"{lab}: train loss (20-step mean)")
    es = sorted(ev)
    top.plot(es, [ev[s] for s in es], "o--", color=c, ms=3, label=f"{lab}: eval loss")
top.set_ylabel("loss")
top.set_yscale("log")
top.legend()
top.set_title(o.title)
bot.plot(steps, [100 * (mean(tb, s) / mean(ta, s) - 1) for s in steps], color="C2", label="train")
es = sorted(set(ea) & set(eb))
bot.plot(es, [100 * (eb[s] / ea[s] - 1) for s in es], "o--", color="C3", ms=3, label="eval")
bot.axhline(1, color="gray", lw=0.5)
bot.axhline(-1, color="gray", lw=0.5)
bot.set_ylabel(f"{o.labels[1]} vs {o.labels[0]} (%)")
bot.set_xlabel("step")
bot.legend()
fig.tight_layout()
fig.savefig(o.out, dpi=110)
