"""The warm rank server: ``python -m zerotune.run.warm.server --socket PATH --script SCRIPT``, one per node for the
life of a tuning.

It preloads torch, DeepSpeed and the script's installed top-level imports (`zerotune.run.warm.preload`), then serves
one JSON-line request per connection on a Unix socket (`_answer`: launch, ping), in a single thread: a fork copies
only the calling thread, so the server never starts another. A launch forks a run launcher that does what DeepSpeed's
per-node launcher does, without an exec (`_launcher`). The server kills every run it launched when it stops (on
SIGTERM, SIGINT or SIGHUP, or when its parent, the tuner or a Slurm step's ``slurmstepd``, is gone: `serve`), and
a run when the tuner closes that run's connection before it ended.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import selectors
import signal
import socket
import sys
import time

from zerotune.launchers.contract import DEEPSPEED, TORCHRUN, torchrun_env
from zerotune.run.warm import rank as warm_rank
from zerotune.run.warm.preload import fork_unsafe, learn, learnable, preload, preload_ops, watch_parent

__all__ = ["main", "rank_environment"]

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
"""Blocked across each fork, so that a stop signal is never handled by the child with its parent's handler: the
child installs its own, then unblocks them."""
PARENT_POLL_S = 0.2  # how often the server checks that the tuner is alive, s
RANK_TERM_WAIT_S = 30.0  # DeepSpeed's launcher: terminate_process_tree waits 30 s before SIGKILL


def rank_environment(env: dict[str, str], slots: list[int], local_rank: int, master_addr: str,
                     master_port: int, contract: str = DEEPSPEED) -> dict[str, str]:
    """The environment the launcher of ``contract`` gives local rank ``local_rank`` of a one-node run on ``slots``.

    DeepSpeed's per-node launcher (``deepspeed/launcher/launch.py``): ``env`` with the accelerator's visible devices
    set to ``slots`` (DeepSpeed's own ``set_visible_devices_envs``: ``CUDA_VISIBLE_DEVICES`` on CUDA and on CPU),
    ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``, ``LOCAL_SIZE``, ``RANK`` and
    ``LOCAL_RANK``. torchrun's (`zerotune.launchers.contract.torchrun_env`): ``env`` with ``MASTER_ADDR``,
    ``MASTER_PORT``, the visible devices as for DeepSpeed's (as a user sets them before torchrun) and its worker
    variables."""
    from deepspeed.accelerator import get_accelerator
    out = dict(env)
    get_accelerator().set_visible_devices_envs(out, slots)
    out.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
    if contract == TORCHRUN:
        return torchrun_env(out, local_rank, local_rank, len(slots), len(slots))
    out.update({"WORLD_SIZE": str(len(slots)), "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(len(slots)),
                "RANK": str(local_rank), "LOCAL_RANK": str(local_rank)})
    return out


class _Stop(Exception):
    """A stop signal reached the server."""


def _prctl(option: int, value: int) -> None:
    """``prctl(option, value)`` (Linux; elsewhere nothing). Not `zerotune.run.processes.adopt_orphans`: that
    module's imports (psutil, the experiment record) would sit in the server's heap, and so in every warm rank's."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent ``parent`` exits (``PR_SET_PDEATHSIG``; the server and the launcher are
    single-threaded, so "its parent" is that process): a run's launcher dies with a killed server, a rank with its
    killed launcher. Exits at once if the parent is already gone."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _kill_runs(runs: dict[int, socket.socket], sig: int = signal.SIGKILL) -> None:
    for pid in runs:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass


def _launcher(request: dict, fds: list[int], close: list, learn_dir: str) -> None:
    """The forked run launcher, never returning: DeepSpeed's per-node launcher (``deepspeed/launcher/launch.py``)
    without an exec. It leads a new session as a child subreaper (the backend stops the run as one process group; what
    its ranks orphan stays in its tree), takes the ``RLIMIT_DATA`` its ranks inherit, forks one rank per slot with its
    contract's environment (`rank_environment`; `zerotune.run.warm.rank` runs the script) and waits (`_wait_ranks`);
    SIGTERM or SIGINT stops its ranks (`_stop_ranks`), exit 1. ``fds``: the standard streams the request
    came with (none: ``/dev/null`` and its log files). ``close``: the server's sockets and selector, closed first
    (no rank inherits them). Its local rank 0 writes the modules it imported to ``learn_dir/<launcher pid>.json``
    (`zerotune.run.warm.preload.learn`)."""
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
    """The launcher's fds 0, 1 and 2: those passed with the request, else ``/dev/null`` and the request's
    ``stdout`` and ``stderr`` files (appended)."""
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
    """The environment of each rank the launcher forks: the request's ``rank_env`` (one rank), else one per slot
    (`rank_environment`)."""
    if "rank_env" in request:
        return [{str(k): str(v) for k, v in request["rank_env"].items()}]
    slots = [int(s) for s in request["slots"]]
    contract = request.get("contract", DEEPSPEED)
    return [rank_environment(request["env"], slots, local_rank, request["master_addr"], int(request["master_port"]),
                             contract) for local_rank in range(len(slots))]


def _wait_ranks(ranks: list[int]) -> int:
    """Wait for the launcher's ``ranks``; the launcher's exit status: 0 once all exited 0, else the first failing
    rank's, once the others are stopped; a rank killed by a signal kills the launcher by the same signal (the
    backend then reads -9 as -9)."""
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


def node_name() -> str:
    """This node's name: Slurm's (``SLURMD_NODENAME``, in a task of a step), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def serve(socket_path: str, script: str, parent: int, ready_dir: str | None = None) -> int:
    """Preload for ``script``, then serve launches on ``socket_path`` (``{node}``: `node_name`, so nodes sharing
    ``/tmp`` keep their sockets apart) until stopped or until ``parent`` (the tuner's pid; 0: this process's parent now)
    is no longer this process's parent; with ``ready_dir``, the ping answer is written to ``ready_dir/<node>.json`` once
    it accepts (a tuner on another node cannot see the socket appear)."""
    parent = parent or os.getppid()
    socket_path = socket_path.replace("{node}", node_name())
    started, stop_watch = time.monotonic(), watch_parent(parent)
    done, ops = preload(script), preload_ops()
    stop_watch()  # the serve loop watches from here; no thread may be left at a fork
    unsafe = fork_unsafe()
    print(f"zerotune warm server {os.getpid()}: preloaded {len(done.imported)} modules and {len(ops)} ops in "
          f"{time.monotonic() - started:.2f} s: {', '.join(done.imported + ops)}", file=sys.stderr, flush=True)
    for module, why in done.skipped.items():
        print(f"zerotune warm server: not preloaded: {module}: {why}", file=sys.stderr, flush=True)
    if unsafe:
        print(f"zerotune warm server: launches nothing warm: {unsafe}", file=sys.stderr, flush=True)

    def on_signal(signum, frame):
        raise _Stop(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    server = _Server(socket_path, script, unsafe, done)
    if ready_dir:
        _write_json(os.path.join(ready_dir, f"{node_name()}.json"), _ping(unsafe, done))
    server.loop(parent)
    return 0


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        json.dump(data, f)
    os.replace(f"{path}.{os.getpid()}.tmp", path)


def _ping(unsafe: str | None, done) -> dict:
    return {"pid": os.getpid(), "node": node_name(), "unsafe": unsafe, "imported": done.imported,
            "skipped": done.skipped}


class _Server:
    """The serving loop's state: the listening socket, connections waiting for their request line, runs."""

    def __init__(self, socket_path: str, script: str, unsafe: str | None, done):
        self.socket_path, self.script, self.unsafe, self.done = socket_path, script, unsafe, done
        self.learn_dir = os.path.dirname(os.path.abspath(socket_path))
        os.makedirs(self.learn_dir, mode=0o700, exist_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{socket_path}.{os.getpid()}.tmp"
        self.listener.bind(tmp)
        self.listener.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.pending: dict[socket.socket, bytes] = {}
        self.fds: dict[socket.socket, list[int]] = {}  # file descriptors a pending request came with
        self.runs: dict[int, socket.socket] = {}
        os.replace(tmp, socket_path)  # the path appears only once the server accepts: it is the readiness signal

    def loop(self, parent: int) -> None:
        """Serve until a stop signal, or until ``parent`` (the tuner) is gone; then kill every run."""
        try:
            while os.getppid() == parent:
                for key, _ in self.sel.select(timeout=PARENT_POLL_S):
                    self._readable(key.fileobj)
                self._reap()
        except _Stop:
            pass
        finally:
            _kill_runs(self.runs)
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass

    def _readable(self, conn: socket.socket) -> None:
        if conn is self.listener:
            client, _ = self.listener.accept()
            self.pending[client] = b""
            self.sel.register(client, selectors.EVENT_READ)
            return
        if conn in self.pending:
            try:
                data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            except OSError:
                data, fds = b"", []
            self.pending[conn] += data
            self.fds.setdefault(conn, []).extend(fds)
            if data and b"\n" not in self.pending[conn]:
                return
            line, fds = self.pending.pop(conn), self.fds.pop(conn)
            try:
                pid = _answer(conn, line, fds, self.unsafe, self.done, self.listener,
                              [self.sel, *self.pending, *self.runs.values()], self.learn_dir)
            finally:
                for fd in fds:  # the launcher has its own copies
                    os.close(fd)
            if pid is None:
                self._close(conn)
            else:
                self.runs[pid] = conn
        elif not conn.recv(1 << 20):  # the tuner closed a run's connection before it ended: it gave the run up
            pid = next(p for p, c in self.runs.items() if c is conn)
            _kill_runs({pid: conn})
            self.sel.unregister(conn)

    def _reap(self) -> None:
        """Send the exit status of every run launcher that ended."""
        while self.runs:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.runs.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(wait_status)})
                self._close(conn)
                self._learn(pid)

    def _learn(self, pid: int) -> None:
        """Import what run ``pid``'s rank 0 imported after its fork (`zerotune.run.warm.preload.learn`)."""
        path = os.path.join(self.learn_dir, f"{pid}.json")
        try:
            with open(path) as f:
                modules = json.load(f)
            os.unlink(path)
        except (OSError, ValueError):
            return
        wanted = learnable(modules if isinstance(modules, list) else [], self.script)
        started = time.monotonic()
        imported, why_not = learn(wanted)
        if imported or why_not:
            print(f"zerotune warm server: learnt {len(imported)} of {len(wanted)} modules run {pid} imported, in "
                  f"{time.monotonic() - started:.2f} s" + (f"; none imported: {why_not}" if why_not else ""),
                  file=sys.stderr, flush=True)

    def _close(self, conn: socket.socket) -> None:
        if self.sel.get_map().get(conn) is not None:
            self.sel.unregister(conn)
        conn.close()


def _answer(conn: socket.socket, line: bytes, fds: list[int], unsafe: str | None, done, listener: socket.socket,
            others: list, learn_dir: str) -> int | None:
    """Answer one request; the pid of the run launched (its connection stays open for the exit status), or None.
    One JSON line each way (a refusal: ``{"error": ...}``)::

        -> {"op": "launch", "script", "args": [...], "env": {...}, "cwd", "slots": [0, 1], "master_addr", "master_port",
            "stdout": PATH, "stderr": PATH, "data_limit": BYTES or null, "probe_dir": PATH or null, "contract"}
        -> {"op": "launch", "script", "args", "rank_env": {...}, "cwd", "affinity": [CPU, ...], "data_limit",
            "probe_dir", "contract"} + fds 0, 1, 2 (SCM_RIGHTS): one rank with DeepSpeed's environment already (a Slurm
            task's, `zerotune.run.backends.slurm_rank`), on that task's streams and CPUs; the task stands for it
        <- {"pid": PID}, the run's launcher (a session of its own), then {"exit": STATUS} (negative: killed by a signal)
        -> {"op": "ping"}   <- {"pid", "node", "unsafe": REASON or null, "imported": [...], "skipped": {...}}
    """
    try:
        request = json.loads(line)
    except ValueError as e:
        _send(conn, {"error": f"not a JSON request: {e}"})
        return None
    if request.get("op") == "ping":
        _send(conn, _ping(unsafe, done))
        return None
    if request.get("op") != "launch":
        _send(conn, {"error": f"unknown op {request.get('op')!r}"})
        return None
    if unsafe:
        _send(conn, {"error": f"the server launches nothing warm: {unsafe}"})
        return None
    server_pid = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        pid = os.fork()
    except OSError as e:
        _send(conn, {"error": f"fork failed: {e}"})
        return None
    finally:
        if os.getpid() == server_pid:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if pid == 0:
        _launcher(request, fds, [listener, conn, *others], learn_dir)
    _send(conn, {"pid": pid})
    return pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerotune.run.warm.server")
    parser.add_argument("--socket", required=True, help="the Unix socket to serve on ({node}: this node's name)")
    parser.add_argument("--script", required=True, help="the training script whose imports are preloaded")
    parser.add_argument("--parent", type=int, required=True,
                        help="the tuner's pid: the server ends with it (0: the server's parent now)")
    parser.add_argument("--ready", help="write DIR/<node>.json once serving (the ping answer)")
    args = parser.parse_args(argv)
    return serve(args.socket, args.script, args.parent, args.ready)


if __name__ == "__main__":
    sys.exit(main())
