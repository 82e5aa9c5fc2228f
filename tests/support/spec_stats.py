"""Chi-square helpers for the speculative-decoding distribution tests (no scipy here)."""

from __future__ import annotations

from collections import Counter

import torch


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(counts: Counter, probs: dict, min_expected: float = 5.0) -> float:
    """p-value of observed `counts` against `probs`; cells expected below min_expected are pooled."""
    n = sum(counts.values())
    stat, dof, pooled_o, pooled_e = 0.0, -1, 0.0, 0.0
    for key, p in probs.items():
        e = n * p
        if e < min_expected:
            pooled_o += counts.get(key, 0)
            pooled_e += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        dof += 1
    pooled_o += sum(c for k, c in counts.items() if k not in probs)
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        dof += 1
    return chi2_sf(stat, max(dof, 1))


def two_sample(a: Counter, b: Counter, min_count: int = 10) -> float:
    """p-value of the chi-square test that samples `a` and `b` come from one distribution
    (a 2 x C contingency table; categories seen fewer than min_count times in all are pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = set(a) | set(b)
    big = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= min_count]
    rows = [(a.get(k, 0), b.get(k, 0)) for k in big]
    rest = (na - sum(r[0] for r in rows), nb - sum(r[1] for r in rows))
    if sum(rest) > 0:
        rows.append(rest)
    stat = 0.0
    for oa, ob in rows:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return chi2_sf(stat, max(len(rows) - 1, 1))
