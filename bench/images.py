"""Synthetic test images: kept here for the benchmarks and tests that import them from bench."""

from clipserve.bench.images import encode, jpeg, synthetic_image

__all__ = ["encode", "jpeg", "synthetic_image"]
