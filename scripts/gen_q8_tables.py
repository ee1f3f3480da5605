#!/usr/bin/env python3
"""Prints the code tables of the 8-bit AdamW state (src/ops/adamw/q8_state.h, docs/memory.md), exactly.

Each value is the fp32 nearest (ties to even) to an exact rational, computed with fractions (no double rounding):
  m (signed, sign + 7-bit magnitude): 0, then bitsandbytes' dynamic-tree magnitudes (Dettmers et al. 2022,
    create_dynamic_map(signed=True)): for decade i = 0..6 (scale 10^(i-6)), 2^i values
    10^(i-6) * (0.1 + 0.9 * (2q + 1) / 2^(i+1)), q = 0..2^i - 1; the largest (0.99297) is replaced by 1.0;
  r = sqrt(v) (unsigned, 8 bits): 0, then for i = 0..6, 2^(i+1) values 10^(i-6) * (0.1 + 0.9 * (2q + 1) / 2^(i+2)),
    then 1.0 (create_dynamic_map(signed=False));
  thresholds: the fp32 nearest to the exact mean of two neighbouring values; r's first threshold is 0 instead (only
    an exact 0 quantizes to code 0).
Usage: python3 scripts/gen_q8_tables.py  (paste the output into q8_state.h).
"""
import math
import re
from fractions import Fraction as F


def f32(x):
    """The fp32 nearest to the Fraction x >= 0 (round half to even; no subnormals occur here)."""
    if x == 0:
        return 0.0
    e = math.floor(math.log2(x.numerator) - math.log2(x.denominator))
    while F(2) ** e > x:
        e -= 1
    while F(2) ** (e + 1) <= x:
        e += 1
    q = x / F(2) ** (e - 23)  # in [2^23, 2^24)
    n = q.numerator // q.denominator
    r = q - n
    if r > F(1, 2) or (r == F(1, 2) and n % 2 == 1):
        n += 1
    return float(F(n) * F(2) ** (e - 23))


def means(i, n):
    return [F(10) ** (i - 6) * (F(1, 10) + F(9, 10) * F(2 * q + 1, 2 * n)) for q in range(n)]


def tables():
    mag = [F(0)]
    for i in range(7):
        mag += means(i, 2 ** i)
    mag[-1] = F(1)
    uns = [F(0)]
    for i in range(7):
        uns += means(i, 2 ** (i + 1))
    uns.append(F(1))
    assert len(mag) == 128 and len(uns) == 256
    mag = [f32(x) for x in mag]
    uns = [f32(x) for x in uns]
    assert mag == sorted(mag) and uns == sorted(uns)
    thr = lambda v: [f32((F(v[j]) + F(v[j + 1])) / 2) for j in range(len(v) - 1)]
    mt, ut = thr(mag), thr(uns)
    ut[0] = 0.0
    return mag, mt, uns, ut


def hexf(v):
    if v == 0:
        return "0x0p+0"
    m = re.match(r"0x1\.([0-9a-f]*)p([-+]\d+)", float.hex(v))
    frac = m.group(1).rstrip("0")
    return "0x1" + ("." + frac if frac else "") + "p" + m.group(2)


def emit(name, vals):
    items = [hexf(v) + "f" for v in vals]
    lines, line = [], "  "
    for it in items:
        if len(line) + len(it) + 2 > 118:
            lines.append(line.rstrip())
            line = "  "
        line += it + ", "
    lines.append(line.rstrip().rstrip(","))
    print(f"#define {name} \\")
    print(" \\\n".join(lines))
    print()


if __name__ == "__main__":
    mag, mt, uns, ut = tables()
    emit("DS_Q8_M_MAGNITUDES", mag)
    emit("DS_Q8_M_THRESHOLDS", mt)
    emit("DS_Q8_R_VALUES", uns)
    emit("DS_Q8_R_THRESHOLDS", ut)
