"""Outrider: distributed, disaggregated speculative decoding."""

__version__ = "0.1.0"
