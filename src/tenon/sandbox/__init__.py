"""Sandbox backends behind one Protocol (see sandbox.base)."""
