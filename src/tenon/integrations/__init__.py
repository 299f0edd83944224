"""Adapters that let agent frameworks run their actions on Tenon through its E2B-compatible
service. Each adapter imports its framework, an optional dependency, only when the adapter
module itself is imported."""
