"""Interleaved A/B rounds read as pairs: what a change adds to a run that a shared disk makes noisy.

Why pairs: a fastest-of or median-of ratio compares two runs that may have met different moments of the
disk (one save of the same bytes varies by 7-10% on the 2-core machine, by +-1 s of 14 on the H200 host);
each round runs both kinds back to back (the order flipped every round), so a round's two runs met
nearly the same moment, and the spread of the per-round ratios gives a standard error.
"""

from __future__ import annotations

import statistics


def paired(without: list[float], with_: list[float]) -> dict[str, str]:
    """The median of the per-round ratios ``with / without - 1``, and their mean with its standard error and
    one-sided 95% upper bound (normal approximation)."""
    r = [(w / o - 1) * 100 for o, w in zip(without, with_)]
    mean = statistics.fmean(r)
    se = statistics.stdev(r) / len(r) ** 0.5 if len(r) > 1 else float("nan")
    return {"added (paired median)": f"{statistics.median(r):+.1f}%",
            "added (paired mean ± se)": f"{mean:+.1f}% ± {se:.1f}", "95% bound": f"{mean + 1.645 * se:+.1f}%"}
