#!/usr/bin/env python3
"""Compares two runs' metrics.jsonl (the fp32 and the bf16 optimizer state): training loss smoothed over a window
of steps, and eval loss, as relative differences (b - a) / a. Prints a table at every eval step, the largest
differences after warm-up, and whether the final eval loss (the last eval step both runs have) is within the band:
`within 1.0%: yes|no` (exit 1 on no or on missing data; the issues' criterion).
Usage: compare_curves.py A.jsonl B.jsonl [--window 20] [--after 30] [--band 0.01]
"""
import argparse
import json
import sys


def load(path):
    loss, ev = {}, {}
    for line in open(path):
        j = json.loads(line)
        if "loss" in j:
            loss[j["step"]] = j["loss"]
        if "eval_loss" in j:
            ev[j["step"]] = j["eval_loss"]
    return loss, ev


def smooth(loss, step, window):
    xs = [loss[s] for s in range(step - window + 1, step + 1) if s in loss]
    return sum(xs) / len(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--after", type=int, default=30)
    ap.add_argument("--band", type=float, default=0.01)
    o = ap.parse_args()
    (la, ea), (lb, eb) = load(o.a), load(o.b)
    steps = sorted(set(la) & set(lb))
    if not steps or not (set(ea) & set(eb)):
        sys.exit("compare_curves: no common steps")
    print(f"{'step':>5} {'loss A (avg)':>13} {'loss B (avg)':>13} {'rel':>8} {'eval A':>8} {'eval B':>8} {'rel':>8}")
    for s in sorted(set(ea) & set(eb)):
        if s in la and s in lb:
            a, b = smooth(la, s, o.window), smooth(lb, s, o.window)
            tr = f"{a:13.4f} {b:13.4f} {(b - a) / a:+8.2%}"
        else:
            tr = f"{'':13} {'':13} {'':8}"
        print(f"{s:5d} {tr} {ea[s]:8.4f} {eb[s]:8.4f} {(eb[s] - ea[s]) / ea[s]:+8.2%}")
    late = [s for s in steps if s > o.after]
    worst_train = max(abs(smooth(lb, s, o.window) / smooth(la, s, o.window) - 1) for s in late)
    worst_eval = max(abs(eb[s] / ea[s] - 1) for s in set(ea) & set(eb) if s > o.after)
    last = max(set(ea) & set(eb))
    final = eb[last] / ea[last] - 1
    ok = abs(final) <= o.band
    print(f"after step {o.after}: largest |rel| train loss ({o.window}-step mean) {worst_train:.2%}, eval loss "
          f"{worst_eval:.2%}")
    print(f"final eval loss (step {last}): {ea[last]:.4f} -> {eb[last]:.4f}, {final:+.2%}; within {o.band:.1%}: "
          f"{'yes' if ok else 'no'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
