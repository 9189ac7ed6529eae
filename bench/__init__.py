"""Benchmarks of hpcinfer against reference implementations (see bench/README.md)."""
