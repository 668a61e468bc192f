"""The forked run launcher of the warm server (`zerotune.run.warm.server`): what DeepSpeed's per-node launcher
(``deepspeed/launcher/launch.py``) does, without an exec (`become_launcher`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

from zerotune.launchers.contract import DEEPSPEED, TORCHRUN, torchrun_env
from zerotune.run.warm import rank as warm_rank

__all__ = ["STOP_SIGNALS", "become_launcher", "die_with_parent", "rank_environment"]

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
"""Blocked across each fork, so that a stop signal is never handled by the child with its parent's handler: the
child installs its own, then unblocks them."""
RANK_TERM_WAIT_S = 30.0  # DeepSpeed's launcher: terminate_process_tree waits 30 s before SIGKILL


def rank_environment(env: dict[str, str], slots: list[int], local_rank: int, master_addr: str,
                     master_port: int, contract: str = DEEPSPEED) -> dict[str, str]:
    """The environment the launcher of ``contract`` gives local rank ``local_rank`` of a one-node run on ``slots``:
    ``env`` with the visible devices set to ``slots`` (DeepSpeed's ``set_visible_devices_envs``), ``MASTER_ADDR``,
    ``MASTER_PORT`` and the contract's rank variables (DeepSpeed's ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``...; or
    `zerotune.launchers.contract.torchrun_env`)."""
    from deepspeed.accelerator import get_accelerator
    out = dict(env)
    get_accelerator().set_visible_devices_envs(out, slots)
    out.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
    if contract == TORCHRUN:
        return torchrun_env(out, local_rank, local_rank, len(slots), len(slots))
    out.update({"WORLD_SIZE": str(len(slots)), "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(len(slots)),
                "RANK": str(local_rank), "LOCAL_RANK": str(local_rank)})
    return out


def _prctl(option: int, value: int) -> None:
    """``prctl(option, value)`` (Linux; elsewhere nothing); not `zerotune.run.processes`', whose imports would sit in
    every warm rank's heap."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its (single-threaded) parent ``parent`` exits (``PR_SET_PDEATHSIG``); exits at once
    if it is already gone."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def become_launcher(request: dict, fds: list[int], close: list, learn_dir: str) -> None:
    """The forked run launcher, never returning. It leads a new session as a child subreaper (stopped as one process
    group), takes the ``RLIMIT_DATA`` its ranks inherit, forks one rank per slot (`rank_environment`;
    `zerotune.run.warm.rank` runs the script) and waits; SIGTERM or SIGINT stops its ranks, exit 1. ``fds``: the
    request's standard streams (none: ``/dev/null`` and its log files). ``close``: the server's sockets and
    selector, closed first. Local rank 0 writes the modules it imported to ``learn_dir/<launcher pid>.json``."""
    status = 1
    server = os.getppid()
    try:
        for s in close:
            s.close()
        os.setsid()
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        die_with_parent(server)
        if request.get("data_limit"):
            import resource
            limit = int(request["data_limit"])
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        if request.get("affinity"):
            os.sched_setaffinity(0, [int(c) for c in request["affinity"]])
        _standard_streams(request, fds)
        envs = _rank_envs(request)
        ranks: list[int] = []
        launcher = os.getpid()

        def stop(signum=None, frame=None, code: int = 1):
            _stop_ranks(ranks)
            os._exit(code)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the server across the fork
        for env in envs:
            sys.stdout.flush()
            sys.stderr.flush()
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            pid = os.fork()
            if pid == 0:
                die_with_parent(launcher)
                learn_path = os.path.join(learn_dir, f"{launcher}.json") if env.get("LOCAL_RANK") == "0" else None
                warm_rank.become_rank(request["script"], list(request["args"]), env, request["cwd"],
                                      request.get("probe_dir"), learn_path, request.get("contract", DEEPSPEED))
            ranks.append(pid)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        status = _wait_ranks(ranks)
    except BaseException as e:  # noqa: BLE001 - any failure here is the launch's, reported as a setup failure
        try:
            os.write(2, f"{warm_rank.SETUP_FAILED_LINE}: launcher: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
        status = warm_rank.SETUP_FAILED
    os._exit(status)


def _standard_streams(request: dict, fds: list[int]) -> None:
    """Set fds 0, 1, 2: those passed with the request, else ``/dev/null`` and its ``stdout``/``stderr`` (appended)."""
    if fds:
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        return
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, target)
        os.close(out)


def _rank_envs(request: dict) -> list[dict[str, str]]:
    """Each rank's environment: the request's ``rank_env`` (one rank), else one per slot (`rank_environment`)."""
    if "rank_env" in request:
        return [{str(k): str(v) for k, v in request["rank_env"].items()}]
    slots = [int(s) for s in request["slots"]]
    contract = request.get("contract", DEEPSPEED)
    return [rank_environment(request["env"], slots, local_rank, request["master_addr"], int(request["master_port"]),
                             contract) for local_rank in range(len(slots))]


def _wait_ranks(ranks: list[int]) -> int:
    """Wait for ``ranks``; returns 0 once all exited 0, else the first failing rank's status once the others are
    stopped; a rank killed by a signal kills the launcher by the same signal."""

    alive = set(ranks)
    while alive:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            break
        if pid not in alive:  # an orphan of a rank, adopted by this subreaper
            continue
        alive.discard(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _stop_ranks([r for r in ranks if r in alive])
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code & 0xFF
    return 0


def _stop_ranks(ranks: list[int]) -> None:
    """SIGTERM the ranks' trees, SIGKILL what is left after `RANK_TERM_WAIT_S` (DeepSpeed's launcher's
    ``terminate_process_tree``)."""
    import psutil
    procs = []
    for pid in ranks:
        try:
            p = psutil.Process(pid)
            procs += p.children(recursive=True) + [p]
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=RANK_TERM_WAIT_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
