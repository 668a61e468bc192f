"""What a launch costs through the Ray backend, cold against warm: the same tuning, ``--cold-launch`` and not, A B A B.

The case is benchmarks/slurm_overhead.py's (``examples/train_gpt.py`` tiny, ZeRO stage 1, mbs up to 2, 2 CPU ranks,
6 steps), on a one-node Ray cluster this script holds (2 CPUs, 2 logical GPUs that count the CPU ranks, on
127.0.0.1). Each tuning gets a fresh results dir; the figures are its wall, its launches and the
median start-up per launch (the records' ``startup_s``).

    OMP_NUM_THREADS=1 python -m benchmarks.ray_warm [--rounds 2]

Prints one line and writes benchmarks/results/ray_warm.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.slurm_overhead import compare

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    temp = tempfile.mkdtemp(prefix="zt-ray-")  # Ray's socket paths must fit 107 bytes
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_memory_monitor_refresh_ms="0", OMP_NUM_THREADS="1")
    import ray  # the head runs in this process, as tests/e2e/test_ray.py's does; the tunings connect to it

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 * 2**20, _temp_dir=temp, log_to_driver=False)
    try:
        backend = ["--backend", "ray", "--address", ray.get_runtime_context().gcs_address, "--num_gpus", "2"]
        out = {"load_before": os.getloadavg(),
               "one_node": compare("Ray, one node, 2 CPU ranks", ("cold", [], [*backend, "--cold-launch"], {}),
                                   ("warm", [], backend, {}), args.rounds),
               "load_after": os.getloadavg()}
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    path = ROOT / "benchmarks" / "results" / "ray_warm.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
