"""The benchmarks' own logic checked: the SIMULATED cluster, the comparison with DeepSpeed's autotuner, the GPU checks."""
