"""Real DeepSpeed and real processes: a tuning, a launcher, a backend (Slurm, Ray, two nodes) end to end on 2 CPU ranks."""
