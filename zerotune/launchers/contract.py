"""What a launcher gives each rank it starts, its environment and arguments, per launcher contract.

A contract is named by a string, so that the warm server (`zerotune.run.warm.server`) and a Slurm task
(`zerotune.run.backends.slurm_rank`) can apply it importing only this module (standard library only: the warm
server's heap is every warm rank's). `DEEPSPEED`: DeepSpeed's per-node launcher's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``...) and ``--local_rank=N``. `TORCHRUN`: torch's elastic agent's (`torchrun_env`; also
Accelerate's one-node DeepSpeed launch, with its own variables). `OWN`: the script starts its own ranks (Lightning
under plain ``python``): zerotune starts one process and gives it nothing of a rank's.
"""
from __future__ import annotations

__all__ = ["CONTRACTS", "DEEPSPEED", "OWN", "TORCHRUN", "rank_argv", "torchrun_env"]

DEEPSPEED = "deepspeed"
TORCHRUN = "torchrun"
OWN = "own"
CONTRACTS = (DEEPSPEED, TORCHRUN, OWN)
WARM_RUN_ID = "zerotune"
"""``TORCHELASTIC_RUN_ID`` of a warm rank (torchrun's own default run id is ``none``)."""


def rank_argv(contract: str, local_rank: int | str) -> list[str]:
    """The arguments the launcher puts before the script's own: ``["--local_rank=N"]`` for `DEEPSPEED` only."""
    return [f"--local_rank={local_rank}"] if contract == DEEPSPEED else []


def torchrun_env(env: dict[str, str], rank: int, local_rank: int, world_size: int, local_world_size: int,
                 node_rank: int = 0, num_nodes: int = 1) -> dict[str, str]:
    """``env`` with the variables torchrun's agent gives the worker of global ``rank`` and ``local_rank``
    (``local_elastic_agent.py``, ``_start_workers``; ``MASTER_ADDR``/``PORT`` are ``env``'s), ``OMP_NUM_THREADS`` 1
    where unset and a node runs several ranks, as torchrun does. No agent runs, so rank 0 hosts the store
    (``TORCHELASTIC_USE_AGENT_STORE=False``), as a static rendezvous does."""
    out = dict(env)
    out.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(node_rank),
                "GROUP_WORLD_SIZE": str(num_nodes), "ROLE_RANK": str(rank), "ROLE_NAME": "default",
                "ROLE_WORLD_SIZE": str(world_size), "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": env.get("TORCHELASTIC_RUN_ID", WARM_RUN_ID),
                "TORCHELASTIC_USE_AGENT_STORE": "False"})
    out.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if local_world_size > 1:
        out.setdefault("OMP_NUM_THREADS", "1")
    return out
