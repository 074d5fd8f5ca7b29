"""ministats: small descriptive statistics without dependencies."""

from ministats.core import mean, median, mode, variance, stdev, percentile
from ministats.series import moving_average, cumulative_sum, normalize, rank

__all__ = ["mean", "median", "mode", "variance", "stdev", "percentile",
           "moving_average", "cumulative_sum", "normalize", "rank"]
