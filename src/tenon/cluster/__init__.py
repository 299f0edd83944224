"""Tenon beyond one host: one Tenon per node and a dispatcher that places agents on nodes."""
