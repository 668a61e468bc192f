"""zerotune's benchmarks, a package: run each from the repository root as ``python -m benchmarks.<name>``;
the SIMULATED cluster is :mod:`benchmarks.simcluster`."""
