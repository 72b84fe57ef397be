"""Shared by the agreement scripts (agreement-guidellm.sh, agreement-vllm-bench.sh): percentiles as
headroom computes them and the gated comparison table against another client."""

import sys


def pct(values, p):
    """np.percentile(values, p) with linear interpolation (as headroom's report.rs)."""
    v = sorted(values)
    rank = p / 100 * (len(v) - 1)
    lo, hi = int(rank), min(int(rank) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def gate(other, rows, tol):
    """Prints `other` against headroom replay, one row per (name, other's ms, replay's ms, gated),
    and exits 1 if a gated row differs by more than `tol` percent (relative to `other`)."""
    print(f"| metric | {other} ms | headroom replay ms | diff |")
    print("|---|---|---|---|")
    fail = []
    for name, ov, hv, gated in rows:
        d = (hv - ov) / ov * 100
        print(f"| {name} | {ov:.2f} | {hv:.2f} | {d:+.1f} % |")
        if gated and abs(d) > tol:
            fail.append(name)
    print()
    if fail:
        print(f"FAIL: {', '.join(fail)} differ by more than {tol:g} %")
        sys.exit(1)
    print(f"PASS: TTFT and TPOT p50/p99 agree within {tol:g} %")
