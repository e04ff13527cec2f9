"""The training rows of a metric stream as per-key columns with prefix sums: what the rules read.

Window means, standard errors and least-squares trends are O(1) from the prefix sums, so a rule
check is cheap and a replay of a long run stays linear.
"""

from __future__ import annotations

import bisect
import math
from array import array
from typing import Any, Iterable, Mapping

from pipeline.rundir.metric_names import CAP_METRIC, TRAIN_KEYS, is_train_row, number

NAN = float("nan")
# History keeps only what the rules and the report read (a live run logs ~50 keys for thousands of steps).
TRACKED = frozenset(TRAIN_KEYS) | {CAP_METRIC, "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy_coef", "learning_rate"}
MAX_REWARD_KEYS = 32  # the first rewards/<name>/... keys kept (of at most 100 characters): a run logs a mean and std per component


class History:
    """The training rows seen so far, as per-key columns with prefix sums (append-only, compact arrays)."""

    def __init__(self, rows: Iterable[Mapping[str, Any]] = ()):
        self.steps: list[int] = []
        self._raw: dict[str, array] = {}
        self._sum: dict[str, array] = {}
        self._sq: dict[str, array] = {}
        self._cnt: dict[str, array] = {}
        self._si: dict[str, array] = {}  # sums of the row index, its square, and index x value: trend fits
        self._si2: dict[str, array] = {}
        self._siv: dict[str, array] = {}
        self._reward_keys = 0  # rewards/... keys tracked (a hand-made log could have thousands)
        for r in rows:
            self.append(r)

    def __len__(self) -> int:
        return len(self.steps)

    def append(self, row: Mapping[str, Any]) -> bool:
        """Add one logged row; returns False (and ignores it) unless it is a training row."""
        if not is_train_row(row):
            return False
        n = len(self.steps)
        step = number(row.get("step"))
        self.steps.append(int(step) if step is not None else (self.steps[-1] + 1 if n else 0))
        for k, v in row.items():
            if k in self._raw or number(v) is None:
                continue
            if k not in TRACKED:
                if not k.startswith("rewards/") or len(k) > 100 or self._reward_keys >= MAX_REWARD_KEYS:
                    continue
                self._reward_keys += 1
            self._raw[k], self._sum[k] = array("d", [NAN]) * n, array("d", [0.0]) * (n + 1)
            self._sq[k], self._cnt[k] = array("d", [0.0]) * (n + 1), array("q", [0]) * (n + 1)
            self._si[k], self._si2[k], self._siv[k] = (array("d", [0.0]) * (n + 1) for _ in range(3))
        for k, raw in self._raw.items():
            v = number(row.get(k))
            raw.append(NAN if v is None else v)
            x = float(n) if v is not None else 0.0
            self._sum[k].append(self._sum[k][-1] + (v or 0.0))
            self._sq[k].append(self._sq[k][-1] + (v or 0.0) * (v or 0.0))  # inf past 1e154, where ** raises
            self._cnt[k].append(self._cnt[k][-1] + (v is not None))
            self._si[k].append(self._si[k][-1] + x)
            self._si2[k].append(self._si2[k][-1] + x * x)
            self._siv[k].append(self._siv[k][-1] + x * (v or 0.0))
        return True

    def keys(self) -> list[str]:
        return list(self._raw)

    def values(self, key: str) -> list[float]:
        """The values present for key, in order."""
        return [v for v in self._raw.get(key, []) if not math.isnan(v)]

    def value(self, key: str, i: int) -> float | None:
        raw = self._raw.get(key)
        return None if raw is None or math.isnan(raw[i]) else raw[i]

    def count(self, key: str, a: int, b: int) -> int:
        c = self._cnt.get(key)
        return 0 if c is None else c[b] - c[max(a, 0)]

    def mean(self, key: str, a: int, b: int, min_count: int = 1) -> float | None:
        """Mean of the values present in rows [a, b); None with fewer than min_count of them."""
        a = max(a, 0)
        n = self.count(key, a, b)
        return None if n < max(min_count, 1) else (self._sum[key][b] - self._sum[key][a]) / n

    def sem(self, key: str, a: int, b: int) -> float:
        """Standard error of that mean (inf with fewer than 2 values)."""
        a = max(a, 0)
        n = self.count(key, a, b)
        if n < 2:
            return math.inf
        m = (self._sum[key][b] - self._sum[key][a]) / n
        var = max((self._sq[key][b] - self._sq[key][a]) / n - m * m, 0.0) * n / (n - 1)
        return math.sqrt(var / n)

    def trend(self, key: str, a: int, b: int, min_count: int = 3) -> tuple[float, float] | None:
        """Least-squares slope of key per logged row over rows [a, b) and its standard error (O(1));
        None with fewer than min_count values."""
        a = max(a, 0)
        n = self.count(key, a, b)
        if n < max(min_count, 3):
            return None
        d = lambda arr: arr[key][b] - arr[key][a]  # noqa: E731
        sx, sy, sxx, sxy, syy = d(self._si), d(self._sum), d(self._si2), d(self._siv), d(self._sq)
        cxx, cxy, cyy = sxx - sx * sx / n, sxy - sx * sy / n, syy - sy * sy / n
        if cxx <= 0:
            return None
        slope = cxy / cxx
        resid = max(cyy - slope * cxy, 0.0) / (n - 2)
        return slope, math.sqrt(resid / cxx)

    def first_index_with(self, key: str, k: int) -> int | None:
        """Prefix length at which the k-th value of key is present, or None."""
        c = self._cnt.get(key)
        if c is None or c[-1] < k:
            return None
        return bisect.bisect_left(c, k)

