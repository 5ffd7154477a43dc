"""Benchmarks: every speed claim of flashpd is measured here, under the experiment protocol."""
