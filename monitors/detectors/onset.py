"""Onset estimation: where did a series leave its baseline?

A detector fires some steps *after* the series started to misbehave (it needs the excess to
clear a noise threshold, then k confirming points). The rollback target has to precede the
true onset, so at detection time we search back over the bounded buffer for one change point.

Model (segmented least squares, one break, all in the detector's own space, e.g. log values):

    y_t = a + d*t                                   for t <= tau   (baseline, may drift)
    y_t = a + d*t + c + b*(t - tau)                 for t >  tau   (jump c, extra slope b)

The jump term catches a loss spike (a step), the hinge term catches exponential growth (a
ramp in log space, YaLM's "attention maxima began to grow sharply"), and the drift term keeps a
slowly falling loss or slowly rising logit from being read as the change. For every candidate
tau the 4 coefficients have a closed-form least-squares fit; we take the tau with the smallest
residual sum of squares (equivalently the largest Gaussian split likelihood), with c, b >= 0
(the break is upward). The break counts
only when it beats both the no-change line `a + d*t` and the best *downward* break by a BIC
margin (3 extra parameters: c, b, tau) and moves the series *up* at the last point; otherwise the caller falls back to
"first step outside the baseline band". Cost: O(n^2) for an n-point buffer, paid only when a
detector fires, so updates stay O(1) amortised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ChangePoint:
    """`onset_step` is the first step of the changed regime (the first point off the baseline)."""

    onset_step: int
    last_baseline_step: int
    gain: float  # n * ln(SSE_no_change / SSE_change): log-likelihood ratio x 2
    shift: float  # fitted excess over the baseline line at the last point (c + b*(t_n - tau))


def change_point(
    steps: np.ndarray | list[int],
    values: np.ndarray | list[float],
    min_baseline: int = 4,
    penalty: float = 3.0,
) -> ChangePoint | None:
    """Single best upward break in `values` (indexed by `steps`), or None if none is credible.

    `min_baseline` points must precede the break so the baseline line is determined.
    `penalty` is the number of extra parameters charged at ln(n) each (BIC).
    """
    t = np.asarray(steps, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(y) & np.isfinite(t)
    t, y = t[ok], y[ok]
    y = y - y.mean() if y.size else y  # the model has an intercept; centring only helps precision
    n = t.size
    if n < min_baseline + 2:
        return None
    # Scale time to [0, 1] so the 4x4 normal equations stay well conditioned.
    t0, span = t[0], max(t[-1] - t[0], 1.0)
    u = (t - t0) / span
    cand = np.arange(min_baseline - 1, n - 1)  # index of the last baseline point
    tau = u[cand][:, None]
    post = (u[None, :] > tau).astype(np.float64)  # (m, n) indicator of the changed regime
    hinge = (u[None, :] - tau) * post  # (m, n) ramp after the break

    sse_up, beta = _best_upward_fit(u, y, post, hinge)
    sse_down, _ = _best_upward_fit(u, -y, post, hinge)  # the best *downward* break, for contrast

    design0 = np.stack([np.ones(n), u], axis=1)
    coef0, *_ = np.linalg.lstsq(design0, y, rcond=None)
    sse0 = float(((y - design0 @ coef0) ** 2).sum())

    # Floor the residual so a noiseless constructed series does not divide by zero; the
    # floor is relative to the series' spread, so it does not favour any particular tau.
    floor = 1e-12 * max(float(np.var(y)) * n, 1e-300)
    sse = np.maximum(np.minimum(sse_up, sse0), floor)  # no feasible fit = no better than no change
    best = int(np.argmin(sse))
    # The upward break must beat both "no change" and "the best downward break": with drift
    # allowed, a drop can otherwise pose as "falling drift + late upward jump".
    null = max(min(sse0, float(np.min(sse_down))), floor)
    gain = n * math.log(null / float(sse[best]))
    i = int(cand[best])
    shift = float(beta[best, 2] + beta[best, 3] * (u[-1] - u[i]))
    if gain <= penalty * math.log(n) or shift <= 0.0:
        return None
    return ChangePoint(
        onset_step=int(t[i + 1]), last_baseline_step=int(t[i]), gain=gain, shift=shift
    )


def estimate_onset(
    steps: np.ndarray | list[int],
    values: np.ndarray | list[float],
    first_exceed_step: int,
    min_baseline: int = 4,
) -> tuple[int, str]:
    """Onset for a finding: the change point when credible and not later than the first step
    that crossed the detector's band, else that first crossing. Returns (step, method).

    Either way the onset is the step after the last point read before the change: on a series
    read every step that is the change's first point; on one read every k-th step (issue 36: a
    thermometer group on its cadence) the change may have begun on any step since that reading,
    and a rollback before the onset must undo all of them."""
    cp = change_point(steps, values, min_baseline=min_baseline)
    if cp is not None and cp.onset_step <= first_exceed_step:
        return cp.last_baseline_step + 1, "change_point"
    t = np.asarray(steps, dtype=np.float64)
    before = t[t < first_exceed_step]
    return (int(before.max()) + 1 if before.size else first_exceed_step), "first_exceed"


def _best_upward_fit(u: np.ndarray, y: np.ndarray, post: np.ndarray, hinge: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate break: least-squares SSE and coefficients (a, d, c, b) of the break model
    with c, b >= 0; SSE is inf where no sign-feasible fit exists."""
    n = u.size
    m = post.shape[0]
    su, suu, sy, suy = u.sum(), (u * u).sum(), y.sum(), (u * y).sum()
    gram = np.empty((m, 4, 4))
    gram[:, 0, 0] = n
    gram[:, 0, 1] = gram[:, 1, 0] = su
    gram[:, 1, 1] = suu
    s_post, s_hinge = post.sum(1), hinge.sum(1)
    gram[:, 0, 2] = gram[:, 2, 0] = s_post
    gram[:, 0, 3] = gram[:, 3, 0] = s_hinge
    gram[:, 1, 2] = gram[:, 2, 1] = post @ u
    gram[:, 1, 3] = gram[:, 3, 1] = hinge @ u
    gram[:, 2, 2] = s_post
    gram[:, 2, 3] = gram[:, 3, 2] = s_hinge  # hinge is zero wherever post is zero
    gram[:, 3, 3] = (hinge * hinge).sum(1)
    rhs = np.empty((m, 4))
    rhs[:, 0], rhs[:, 1], rhs[:, 2], rhs[:, 3] = sy, suy, post @ y, hinge @ y
    yy = float((y * y).sum())

    # An upward change has jump c >= 0 and extra slope b >= 0. Without the signs, a 2-point
    # post segment is fitted exactly by "drop, then climb" one step too early. The constrained
    # least squares optimum is the best sign-feasible fit among the column subsets
    # {c, b}, {c}, {b} (active-set enumeration for two bounded coefficients).
    sse = np.full(m, np.inf)
    beta_best = np.zeros((m, 4))
    for cols in ((0, 1, 2, 3), (0, 1, 2), (0, 1, 3)):
        idx = np.array(cols)
        g = gram[:, idx[:, None], idx[None, :]]
        r = rhs[:, idx]
        # pinv, not solve: with one post point the jump and ramp columns are collinear.
        b = np.einsum("mij,mj->mi", np.linalg.pinv(g), r)
        s = yy - np.einsum("mi,mi->m", b, r)
        full = np.zeros((m, 4))
        full[:, idx] = b
        feasible = (full[:, 2] >= 0) & (full[:, 3] >= 0)
        better = feasible & (s < sse)
        sse = np.where(better, s, sse)
        beta_best[better] = full[better]
    return sse, beta_best
