"""The tuner's side of a warm rank server: start it, ask it for runs, watch them as processes, stop it (D303).

Rules: `WarmServer` starts the server once per tuning, in a session of its own, under a running record, so a rerun
after a SIGKILLed tuner kills a server that outlived it (`zerotune.run.processes.reap_orphans`). `WarmServer.launch`
returns a `WarmRun`, which a backend treats as the ``subprocess.Popen`` of a cold launcher's process group. What
cannot run warm runs cold: `WarmUnavailable` before the launch; after it, `WarmRun.lost` (the server went away, its
processes are killed), as a run whose ranks failed before the script started (`zerotune.run.warm.rank.SETUP_FAILED`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from zerotune.run.backends.stop_handles import SOCKET_DIR_PREFIX, socket_dir_handle
from zerotune.run.processes import RUN_TOKEN_ENV, kill_token, new_run_token, write_running_record
from zerotune.run.store import open_log

__all__ = ["LOST", "AttachedWarmServer", "WarmRun", "WarmServer", "WarmUnavailable"]

log = logging.getLogger(__name__)

LOST = -1000
"""`WarmRun.returncode` of a run whose server went away before it ended (no exit status is known)."""
SERVER_RECORD = "warm-server"  # the running record's name, under the exps dir's running records
READY_TIMEOUT_S = 300.0  # the preload's bound (transformers on a loaded 2-core machine takes ~10 s), s
STOP_WAIT_S = 10.0  # SIGTERM, then SIGKILL after this long, s


class WarmUnavailable(RuntimeError):
    """The server cannot launch this run warm (the message says why); the backend launches it cold."""


class WarmRun:
    """A run launched by a warm server, seen as its launcher process ``pid``: as much of `subprocess.Popen` as the
    backends use. The launcher leads a session of its own, stopped as a cold launcher's process group."""

    def __init__(self, conn: socket.socket, pid: int, received: bytes = b""):
        self.pid = pid
        self.returncode: int | None = None
        self.lost = False  # the server went away before the run ended
        self._conn = conn
        self._buf = received  # what the server sent after the launch's answer (its exit line, for a quick run)

    def _read(self, timeout: float | None) -> None:
        """Read what the server sent within ``timeout`` seconds (None: until the run ends)."""
        if self.returncode is not None:
            return
        if b"\n" not in self._buf:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return
            try:
                data = self._conn.recv(4096)
            except OSError:
                data = b""
            if not data:
                self._lose()
                return
            self._buf += data
            if b"\n" not in self._buf:
                return
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            self.returncode = int(json.loads(line)["exit"])
        except (ValueError, KeyError, TypeError):
            self._lose()
        self._conn.close()

    def _lose(self) -> None:
        """The server is gone: kill the run's session (the launcher and its ranks) and wait for the launcher."""
        self.lost = True
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            psutil.Process(self.pid).wait(timeout=10)
        except (psutil.Error, psutil.TimeoutExpired):
            pass
        self.returncode = LOST
        self._conn.close()

    def poll(self) -> int | None:
        """The run's exit status once it ended (`LOST` if its server went away), else None."""
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the run to end, at most ``timeout`` seconds.

        Raises:
            subprocess.TimeoutExpired: it had not ended by then.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"warm run {self.pid}", timeout)
            self._read(left)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the run's launcher."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _exchange(conn: socket.socket, request: dict) -> tuple[dict, bytes]:
    """Send ``request`` as one JSON line and read the server's first answer line: ``(answer, the bytes after it)``,
    which may hold a quick run's exit line.

    Raises:
        WarmUnavailable: the server did not answer with a JSON line.
    """
    try:
        conn.sendall((json.dumps(request) + "\n").encode())
        received = b""
        while b"\n" not in received:
            data = conn.recv(4096)
            if not data:
                break
            received += data
        line, _, rest = received.partition(b"\n")
        return json.loads(line or b"{}"), rest
    except (OSError, ValueError) as e:
        raise WarmUnavailable(f"the warm server did not answer: {e}") from e


class WarmServer:
    """One warm rank server on this machine for ``script``, with running record ``record`` under ``running_dir``;
    thread-safe. It runs in a session of its own with a run token of its own, and stops once its parent is gone. Its
    Unix socket lives in a private temporary directory (a socket's path is limited to 107 bytes)."""

    def __init__(self, script: str, env: Mapping[str, str], running_dir: Path, record: str = SERVER_RECORD):
        self.script, self.env, self.running_dir, self.record = script, dict(env), Path(running_dir), record
        self._dir = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))
        self.socket_path = self._dir / "server.sock"
        self.log_path = self.running_dir.parent / ".zerotune-warm.log"
        self.token = new_run_token()
        self.proc: subprocess.Popen | None = None
        self.unusable = ""  # why no run is launched warm ('' while it may be)
        self.ping: dict = {}
        self._lock = threading.Lock()
        self._record: Path | None = None

    def start(self) -> None:
        """Start the server process (it preloads in the background; `launch` waits for it)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self.proc is None:
            self.running_dir.mkdir(parents=True, exist_ok=True)
            self._record = write_running_record(self.running_dir, self.record, self.token, None,
                                                stop=socket_dir_handle(self._dir))
            env = {**self.env, RUN_TOKEN_ENV: self.token, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
            with open_log(self.log_path) as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "zerotune.run.warm.server", "--socket", str(self.socket_path),
                     "--script", self.script, "--parent", str(os.getpid())], stdin=subprocess.DEVNULL, stdout=out,
                    stderr=out, env=env, start_new_session=True)

    def ready(self, stop: threading.Event | None = None) -> None:
        """Wait until the server has preloaded and accepts, and ask whether it can launch; a backend waits before it
        starts a run's clock, as the preload is the tuning's cost, not the first run's.

        Raises:
            WarmUnavailable: it exited or did not get ready within `READY_TIMEOUT_S`, it is not fork-safe, or
                ``stop`` was set while waiting.
        """
        with self._lock:
            self._ready(stop)

    def _ready(self, stop: threading.Event | None = None) -> None:
        if self.unusable:
            raise WarmUnavailable(self.unusable)
        if self.ping:
            return
        self._wait_listening(stop)
        answer = self._ask({"op": "ping"})
        if answer.get("unsafe"):
            self.unusable = f"the warm server is not fork-safe: {answer['unsafe']}"
            raise WarmUnavailable(self.unusable)
        self.ping = answer

    def _wait_listening(self, stop: threading.Event | None) -> None:
        """Start the server if need be, and wait until its socket appears; raises as `ready`."""
        if self.proc is None:
            self._start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.socket_path.exists():
            if self.proc.poll() is not None:
                self.unusable = f"the warm server exited ({self.proc.returncode}) before it was ready: see {self.log_path}"
                raise WarmUnavailable(self.unusable)
            if time.monotonic() > deadline:
                self.unusable = f"the warm server was not ready in {READY_TIMEOUT_S:g} s"
                raise WarmUnavailable(self.unusable)
            if stop is not None and stop.is_set():
                raise WarmUnavailable("the tuning was stopped while the warm server preloaded")
            time.sleep(0.02)

    def _ask(self, request: dict) -> dict:
        conn = self._connect()
        try:
            return _exchange(conn, request)[0]
        finally:
            conn.close()

    def _connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.socket_path))
        except OSError as e:
            conn.close()
            raise WarmUnavailable(f"the warm server is not reachable: {e}") from e
        return conn

    def launch(self, request: dict) -> WarmRun:
        """Ask the server to launch a run (the request's fields: `zerotune.run.warm.server`).

        Raises:
            WarmUnavailable: the server cannot launch it; the message says why.
        """
        self.ready()
        conn = self._connect()
        try:
            answer, rest = _exchange(conn, {"op": "launch", **request})
        except WarmUnavailable:
            conn.close()
            raise
        if "pid" not in answer:
            conn.close()
            raise WarmUnavailable(str(answer.get("error") or "the warm server did not launch the run"))
        return WarmRun(conn, int(answer["pid"]), rest)

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after `STOP_WAIT_S`), then every process it forked (by its token): its runs
        end with it."""
        with self._lock:
            proc, self.proc = self.proc, None
            self.unusable = self.unusable or "the warm server was stopped"
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None:  # what it forked carries its token (a fork keeps the server's environ): none outlives it
            kill_token(self.token)
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._record is not None:
            with contextlib.suppress(OSError):  # a results tree made read-only: the rerun reaps the record
                self._record.unlink(missing_ok=True)


class AttachedWarmServer(WarmServer):
    """A warm server at ``socket_path`` that another local process (the Ray backend's host actor) starts and stops."""


    def __init__(self, socket_path: str):
        self.socket_path = Path(socket_path)
        self.proc, self.unusable, self.ping = None, "", {}
        self._lock = threading.Lock()

    def start(self) -> None:
        """Nothing: its owner started it."""

    def _wait_listening(self, stop: threading.Event | None) -> None:
        """Nothing: its owner waited until it listened (the socket is known only then)."""

    def stop(self) -> None:
        """Nothing: its owner stops it."""
