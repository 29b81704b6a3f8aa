"""Benchmarks that run real NIXL agents in separate processes and write JSON plus a plot."""
