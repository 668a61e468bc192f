"""The warm rank server: ``python -m zerotune.run.warm.server --socket PATH --script SCRIPT``, one per node for the
life of a tuning.

It preloads (`zerotune.run.warm.preload`), then serves one JSON-line request per connection on a Unix socket
(`_answer`), in a single thread, as a fork copies only the calling one. A launch forks a run launcher
(`zerotune.run.warm.launcher`). The server kills every run it launched when it stops (a stop signal, or its parent
gone), and a run whose connection the tuner closes before it ended.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import sys
import time

from zerotune.run.warm.launcher import STOP_SIGNALS, become_launcher
from zerotune.run.warm.preload import fork_unsafe, learn, learnable, preload, preload_ops, watch_parent

__all__ = ["main"]

PARENT_POLL_S = 0.2  # how often the server checks that the tuner is alive, s


class _Stop(Exception):
    """A stop signal reached the server."""


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


def node_name() -> str:
    """This node's name: Slurm's (``SLURMD_NODENAME``, in a task of a step), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def serve(socket_path: str, script: str, parent: int, ready_dir: str | None = None) -> int:
    """Preload for ``script``, then serve launches on ``socket_path`` (``{node}``: `node_name`) until stopped or until
    ``parent`` (0: the parent now) is no longer this process's parent; with ``ready_dir``, the ping answer goes to
    ``ready_dir/<node>.json`` once it accepts (a tuner on another node cannot see the socket)."""
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
    """Answer one request; returns the pid of the run launched (its connection stays open for the exit status), or
    None. One JSON line each way (a refusal: ``{"error": ...}``)::

        -> {"op": "launch", "script", "args": [...], "env": {...}, "cwd", "slots": [0, 1], "master_addr", "master_port",
            "stdout": PATH, "stderr": PATH, "data_limit": BYTES or null, "probe_dir": PATH or null, "contract"}
        -> {"op": "launch", "script", "args", "rank_env": {...}, "cwd", "affinity": [CPU, ...], "data_limit",
            "probe_dir", "contract"} + fds 0, 1, 2 (SCM_RIGHTS): one Slurm task's rank, on its streams and CPUs
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
        become_launcher(request, fds, [listener, conn, *others], learn_dir)
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
