"""zerotune's tests, a package: tests and benchmarks import shared helpers as ``tests.<module>``."""
