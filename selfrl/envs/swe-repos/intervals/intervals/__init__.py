"""intervals: closed integer intervals as (start, end) tuples."""

from intervals.ops import merge, overlaps, contains, intersection, total_length
from intervals.search import bisect_left, find_interval, clamp

__all__ = ["merge", "overlaps", "contains", "intersection", "total_length",
           "bisect_left", "find_interval", "clamp"]
