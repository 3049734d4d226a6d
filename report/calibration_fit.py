"""The least-squares fit of calibration, over arrays (no torch, no I/O).

Unknowns are time scales ``s_f = exp(theta_f)`` of the cost-model factors (``s_f = 2``: this
factor's work takes twice what the profile says, its efficiency halves).  Each equation is
one measured figure ``y_i`` (a step time, a forward time, ...) against its prediction
``p_i(s)`` -- a callable, since the prediction is a simulation (overlap and pipeline bubbles
make it non-linear in ``s``).

    minimise  sum_i rho(w_i log(p_i(s) / y_i))  +  ridge * sum_f theta_f^2
              with theta in [log 0.1, log 10],  rho(r) = c^2 log(1 + r^2 / c^2),  c = 0.1

Residuals are logarithmic, so a 10% error weighs the same on a 1 ms figure as on a 10 s one
and a factor of 2 too slow as much as a factor of 2 too fast.  ``rho`` is the Cauchy loss of
robust regression (Holland & Welsch 1977): squared for small residuals, logarithmic beyond
``c``, so a figure the cost model cannot explain at all (a framework overhead it does not
model) does not drag every factor towards it at the expense of the figures it does explain --
on this machine's runs, plain least squares made the fitted half's median error worse.  The small ridge term
(Tikhonov regularisation, Hoerl & Kennard 1970) keeps at 1 -- unchanged -- every direction
the equations do not determine, and stops two nearly collinear factors from being driven
to opposite extremes by the noise of a measurement.  Solved with scipy's trust-region
reflective least squares (Branch, Coleman & Li 1999), Jacobian by 5% finite steps.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.optimize import least_squares

DEFAULT_RIDGE = 1e-3
SCALE_BOUNDS = (0.1, 10.0)    # an efficiency off by more than 10x is a modelling error, not a factor
FD_STEP = 0.05               # finite-difference step in theta (a 5% change of a scale)
ROBUST_SCALE = 0.1           # log errors beyond ~10% count less than squared (Cauchy loss)


def fit_scales(predict: Callable[[np.ndarray], np.ndarray], measured: np.ndarray, num_factors: int,
               ridge: float = DEFAULT_RIDGE, max_evaluations: int = 200,
               weights: np.ndarray | None = None) -> np.ndarray:
    """Scales (num_factors,) minimising the objective above; ``predict(scales) -> (n_eq,)``.

    ``weights`` (n_eq,) multiply the log residuals (default 1 each).
    """
    y = np.asarray(measured, dtype=float)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float)
    if np.any(y <= 0):
        raise ValueError("measured figures must be positive")
    if num_factors == 0:
        return np.zeros(0)
    lo, hi = np.log(SCALE_BOUNDS[0]), np.log(SCALE_BOUNDS[1])

    def residuals(theta: np.ndarray) -> np.ndarray:
        p = np.asarray(predict(np.exp(theta)), dtype=float)
        return np.concatenate([w * np.log(np.maximum(p, 1e-30) / y), np.sqrt(ridge) * theta])

    sol = least_squares(residuals, np.zeros(num_factors), bounds=(lo, hi), method="trf",
                        diff_step=FD_STEP, max_nfev=max_evaluations, x_scale=1.0,
                        loss="cauchy", f_scale=ROBUST_SCALE)
    return np.exp(sol.x)


def relative_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return (np.asarray(predicted, dtype=float) - np.asarray(measured, dtype=float)) / np.asarray(measured, dtype=float)
