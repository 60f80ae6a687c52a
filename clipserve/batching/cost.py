"""What a batch costs on one worker, learned from the batches it ran.

Admission and scheduling ask it how long n images take: t(n) = fixed + per_item * n, fitted by
least squares with exponential forgetting, so the fit follows a device whose speed drifts.
"""

from __future__ import annotations

_FORGET = 0.1  # weight of the newest batch once the first 10 are in
_MIN_SIZE_VARIANCE = 0.25  # below it, all batches had about one size: no slope to fit


class CostModel:
    """Seconds per batch as a function of its size; 0 until a batch has been measured."""

    def __init__(self) -> None:
        self.count = 0
        self.mean_n = 0.0
        self.mean_t = 0.0
        self.var_n = 0.0
        self.cov_nt = 0.0
        self._base = 0.0  # the fitted line, t(n) = base + slope * n: seconds() is asked
        self._slope = 0.0  # for every request, observe() runs once a batch

    @property
    def ready(self) -> bool:
        return self.count > 0

    def observe(self, n: int, seconds: float) -> None:
        self.count += 1
        alpha = max(1.0 / self.count, _FORGET)  # a plain mean at first, then forgetting
        dn, dt = n - self.mean_n, seconds - self.mean_t
        self.mean_n += alpha * dn
        self.mean_t += alpha * dt
        self.var_n = (1 - alpha) * (self.var_n + alpha * dn * dn)
        self.cov_nt = (1 - alpha) * (self.cov_nt + alpha * dn * dt)
        proportional = self.mean_t / max(self.mean_n, 1.0)
        if self.var_n < _MIN_SIZE_VARIANCE:
            self._slope = proportional  # one size seen: assume the cost grows with it
        else:
            self._slope = min(max(self.cov_nt / self.var_n, 0.0), proportional)
        self._base = self.mean_t - self._slope * self.mean_n

    def seconds(self, n: int) -> float:
        """Estimated time of a batch of n. The line goes through the mean batch, its slope kept
        between flat (a fixed cost only) and proportional (a per-item cost only): noise in a
        narrow spread of sizes can never make it negative or steeper than the data allows.
        0 until a batch has been measured."""
        return max(self._base + self._slope * n, 0.0)
