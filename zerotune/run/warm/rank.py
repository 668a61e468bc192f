"""One warm rank: a process forked from the warm server that becomes ``python -u SCRIPT --local_rank=N ARGS...``
(DeepSpeed's launcher) or ``python -u SCRIPT ARGS...`` (torchrun's).

Rules: the rank gets, without an exec, what the launcher gives a rank it starts (`become_rank`), runs the script as
``__main__`` and ends as Python's process would (threads joined, ``atexit`` hooks run, the exit status of
``sys.exit``, 1 after an uncaught exception, a ``KeyboardInterrupt`` re-raised as SIGINT). A failure before the script
starts exits `SETUP_FAILED`, and the backend re-runs the experiment cold (D303).
"""
from __future__ import annotations

import io
import os
import signal
import sys

from zerotune.launchers.contract import DEEPSPEED, rank_argv

__all__ = ["SETUP_FAILED", "become_rank"]

SETUP_FAILED = 121
"""The exit status of a warm rank that failed before the script started (zerotune's fault, not the script's): the
backend re-runs the experiment cold (`zerotune.run.warm.client`)."""
SETUP_FAILED_LINE = "zerotune warm rank: setup failed before the script started"


def _unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=sys.stdout.encoding or "utf-8",
                            errors=sys.stdout.errors or "strict", write_through=True)


def become_rank(script: str, args: list[str], env: dict[str, str], cwd: str, probe_dir: str | None,
                learn_path: str | None = None, contract: str = DEEPSPEED) -> None:
    """Turn this freshly forked process into the rank ``env`` describes and run ``script`` in it; never returns. It
    sets what the launcher would: the environment, ``sys.argv`` (with ``contract``'s rank arguments), ``sys.path[0]``,
    the working directory, unbuffered standard streams, default signal handlers, NumPy's global seed and the step
    probe. With ``learn_path``, the modules the rank imported are written there as JSON once the script ended
    (`zerotune.run.warm.preload.learn`)."""
    before = set(sys.modules)
    try:
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())  # the launcher blocked its stop signals across the fork
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.stdout = sys.__stdout__ = _unbuffered(1)
        sys.stderr = sys.__stderr__ = _unbuffered(2)
        sys.argv = [script, *rank_argv(contract, env["LOCAL_RANK"]), *args]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        if probe_dir:
            from zerotune.probe import sitecustomize as probe
            probe.install(probe_dir)
    except BaseException as e:  # noqa: BLE001 - reported as zerotune's failure, not the script's
        os.write(2, f"{SETUP_FAILED_LINE}: {type(e).__name__}: {e}\n".encode(errors="replace"))
        os._exit(SETUP_FAILED)
    status = _run(script)
    _finalize()
    if learn_path:
        _write_learned(learn_path, [m for m in list(sys.modules) if m not in before])
    os._exit(status)


def _write_learned(path: str, modules: list[str]) -> None:
    try:
        import json
        with open(f"{path}.tmp", "w") as f:
            json.dump(modules, f)
        os.replace(f"{path}.tmp", path)
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


def _run(script: str) -> int:
    """Run ``script`` as ``__main__``; returns the exit status Python would give."""
    import runpy
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return _exit_status(e.code)
    except KeyboardInterrupt:
        _finalize()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException as e:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        sys.excepthook(type(e), e, e.__traceback__)
        return 1
    return 0


def _exit_status(code) -> int:
    """The process exit status of ``sys.exit(code)``, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def _finalize() -> None:
    """What the interpreter does at exit before its C teardown: join threads, run ``atexit`` hooks, flush streams."""

    import atexit
    import threading
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    except Exception:  # noqa: BLE001
        pass
    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
