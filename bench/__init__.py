"""Benchmarks: they print numbers; tests never time anything."""
