"""The E2B-compatible service: `tenon serve` and what it is made of."""
