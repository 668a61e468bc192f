"""The environment Slurm steps and the two-node test cluster's namespaces give the tuner and its ranks."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_env() -> dict[str, str]:
    """srun exports this to the ranks: zerotune (this checkout) importable, one thread per rank."""
    inherited = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), inherited) if p), "OMP_NUM_THREADS": "1"}
