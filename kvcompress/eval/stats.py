"""Statistics of a task sweep: Wilson intervals per cell and paired comparisons on the same samples.

- `wilson`: 95% Wilson score interval of a proportion (Wilson 1927). A task score in [0, 1] is
  treated as successes = sum of scores over n samples (exact for the 0/1 scores of the needle and
  line tasks; for fractional scores of multi-answer tasks it is the usual approximation).
- `sign_test`: exact two-sided sign test on paired score differences (for 0/1 scores this is the
  exact McNemar test: only discordant pairs count), via scipy's binomial test.
- `paired_comparisons`: every method against the best baseline of its (ratio, mode, task) cell,
  pairing records of the same sample (task, length, index, depth).
- `t_interval`: Student-t interval of a mean over independent units (e.g. per-document
  log-perplexities, or their paired differences against the full cache), via scipy.
"""

from __future__ import annotations

import math
from collections import defaultdict

from scipy.stats import binomtest
from scipy.stats import t as student_t

from ..checks import as_count, as_real

Z95 = 1.959963984540054
SAMPLE_KEY = ("task", "length", "index", "depth")
# The record field holding the SHA-256 of the prompt's token ids a cell answered (`integration.model.token_ids_sha256` of
# the context's, then the question's): records of one sample pair only when they answered the same prompt. The prose
# tasks read the running Python's standard library, which changes between versions, so one sample's text can too.
PROMPT_DIGEST = "prompt_sha256"


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) Wilson score interval of successes / n; (nan, nan) for n = 0. z: the normal quantile of the
    confidence, > 0 (the default gives 95%)."""
    n = as_count("n", n, 0)
    successes = as_real("successes", successes, "the sum of the scores")
    if as_real("z", z, "the normal quantile of the confidence, 1.96 for 95%") <= 0:
        raise ValueError(f"z must be > 0 (the normal quantile of the confidence, 1.96 for 95%), got {z!r}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson needs 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # The interval contains p mathematically; clamping keeps it so after rounding (p = 0 or 1 exactly).
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def t_interval(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t interval of the mean of independent values (n - 1 degrees of freedom).

    One value: (value, nan, nan), no interval; none: (nan, nan, nan).
    """
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be a number in (0, 1), e.g. 0.95, got {confidence!r}")
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    mean = sum(values) / n
    if n == 1:
        return mean, float("nan"), float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided p-value of `wins` vs `losses` discordant pairs under no difference (1.0 when none)."""
    wins, losses = as_count("wins", wins, 0), as_count("losses", losses, 0)
    if wins + losses == 0:
        return 1.0
    return float(binomtest(wins, wins + losses, 0.5).pvalue)



def check_one_prompt_per_sample(records: list[dict]) -> None:
    """ValueError when two records of one sample (`SAMPLE_KEY`) answered different prompts (`PROMPT_DIGEST`, where both
    hold it): they come from runs that built the sample differently (another Python's standard library, which gives the
    prose tasks their text, or other task parameters) and must not be paired."""
    prompts: dict[tuple, str] = {}
    for r in records:
        sample, digest = tuple(r.get(k) for k in SAMPLE_KEY), r.get(PROMPT_DIGEST)
        if digest is not None and prompts.setdefault(sample, digest) != digest:
            raise ValueError(f"the records of sample {dict(zip(SAMPLE_KEY, sample))} answered two prompts ({PROMPT_DIGEST} "
                             f"{prompts[sample][:12]}... and {digest[:12]}...; method {r.get('method')!r}, ratio {r.get('ratio')!r}): they "
                             "come from runs that built the sample differently (another Python's standard library, other "
                             "task parameters) and do not pair; compare records of one run")

def paired_comparisons(records: list[dict], baselines: list[str], by: tuple[str, ...] = ("ratio", "mode", "task")) -> list[dict]:
    """Each method against the best of `baselines` in its group `by`, on the samples both answered.

    The best baseline of a group is the one with the highest mean score there (ties: the one with
    more answered samples, then the first by name).
    Returns rows: group fields, method, baseline, n_pairs, method / baseline mean on the pairs,
    wins (method better), losses, p (exact sign test). A scored record (no error, a score, not of the needle grid)
    must have a method, the fields `by` and `SAMPLE_KEY`; two records of one sample that answered different prompts
    (`PROMPT_DIGEST`, where both hold it: e.g. runs on two Python versions, whose standard library gives the prose tasks
    their text, or two task parameters) are a ValueError, as they would not pair.
    """
    if isinstance(baselines, str):
        raise ValueError(f"baselines must be a list of method names, got the string {baselines!r}: pass [{baselines!r}] for one")
    needed = list(dict.fromkeys(("method", *by, *SAMPLE_KEY)))
    scored = []
    for i, r in enumerate(records):
        if r.get("error") is None and r.get("score") is not None and not r.get("grid"):
            missing = [k for k in needed if k not in r]
            if missing:
                raise ValueError(f"records[{i}] lacks {missing}: a scored record needs {needed}, got one with {sorted(r)}")
            scored.append(r)
    check_one_prompt_per_sample(scored)
    groups: dict[tuple, dict[str, dict[tuple, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in scored:
        groups[tuple(r[k] for k in by)][r["method"]][tuple(r[k] for k in SAMPLE_KEY)] = r["score"]
    rows = []
    for group, by_method in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        ranks = {m: (sum(s.values()) / len(s), len(s)) for m, s in by_method.items() if m in baselines}
        if not ranks:
            continue
        best = max(sorted(ranks), key=lambda m: ranks[m])
        for method in sorted(by_method):
            if method == best:
                continue
            mine, theirs = by_method[method], by_method[best]
            common = sorted(set(mine) & set(theirs), key=str)
            if not common:
                continue
            diffs = [mine[k] - theirs[k] for k in common]
            wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
            rows.append(dict(zip(by, group)) | {
                "method": method, "baseline": best, "n_pairs": len(common),
                "method_score": sum(mine[k] for k in common) / len(common),
                "baseline_score": sum(theirs[k] for k in common) / len(common),
                "wins": wins, "losses": losses, "p": sign_test(wins, losses),
            })
    return rows


def paired_difference_interval(first: list[float], second: list[float], z: float = Z95) -> tuple[float, float, float]:
    """(p1 - p2, low, high): Newcombe's square-and-add 95% interval for the difference of two paired proportions.

    Newcombe, "Improved confidence intervals for the difference between binomial proportions based on
    paired data", Statistics in Medicine 17 (1998), method 10: the Wilson intervals of both marginal
    proportions, combined with the continuity-corrected correlation phi of the 2x2 table of pairs.
    Scores must be 0 or 1 (one outcome per pair).
    """
    if len(first) != len(second):
        raise ValueError(f"paired scores must have one entry per pair, got {len(first)} and {len(second)}")
    if any(s not in (0, 1, 0.0, 1.0) for s in (*first, *second)):
        raise ValueError("Newcombe's paired interval needs 0/1 scores")
    n = len(first)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    a = sum(1 for x, y in zip(first, second) if x and y)
    b = sum(1 for x, y in zip(first, second) if x and not y)
    c = sum(1 for x, y in zip(first, second) if not x and y)
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = 0.0
    if margins > 0:
        cross = a * d - b * c
        corrected = cross - n / 2 if cross > n / 2 else (0.0 if cross >= 0 else cross)
        phi = corrected / math.sqrt(margins)
    theta = p1 - p2
    low = theta - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = theta + math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    return theta, max(-1.0, low), min(1.0, high)
