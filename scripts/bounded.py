"""Child processes that end on time, with everything they started.

scripts/gpu-check and scripts/device-run run each step in a child of its own, in a new session (its
own process group), bounded by the deadline that remains. On time-out the whole group is sent
SIGTERM, then SIGKILL after a grace period: a build's compile workers and their Triton compile
processes die with it, instead of holding the GPU and the CPUs past the run's end. A child that
exits on its own has its group cleaned up too (workers it left behind).

Standard library only: the device's image runs this before anything is installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 5.0  # between SIGTERM and SIGKILL
_live: set[Child] = set()  # children started and not yet waited for


@dataclass(frozen=True)
class Finished:
    """How a bounded child ended."""

    returncode: int | None  # None: killed on time-out
    timed_out: bool
    seconds: float
    output: str = ""  # the end of its stdout and stderr

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class Child:
    """One child in its own process group; its stdout and stderr go to ``log`` (a temporary file when
    none is given, so that a grandchild holding the output open cannot keep a wait from ending)."""

    def __init__(
        self, cmd: list[str], *, log: Path | None = None, env: dict | None = None, cwd: str | Path | None = None
    ):
        self.cmd = cmd
        self.start = time.monotonic()
        self._own_log = log is None
        if log is None:
            fd, name = tempfile.mkstemp(prefix="bounded-", suffix=".log")
            os.close(fd)
            log = Path(name)
        self.log = log
        self._log_file = open(log, "w")
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        except OSError:
            self._close()
            raise
        _live.add(self)

    def wait(self, timeout_s: float) -> Finished:
        """Wait at most ``timeout_s`` seconds for the child to exit; on time-out kill its whole group.
        Either way, whatever it left running in its group is killed too."""
        timed_out = False
        try:
            self.proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
            self.proc.wait()
        else:
            kill_group(self.proc.pid, grace_s=0.0)
        _live.discard(self)
        output = self._close()
        return Finished(None if timed_out else self.proc.returncode, timed_out, time.monotonic() - self.start, output)

    def _close(self) -> str:
        self._log_file.close()
        output = _tail(self.log)
        if self._own_log:
            self.log.unlink(missing_ok=True)
        return output

    def kill(self) -> None:
        kill_group(self.proc.pid, reap=self.proc.poll)


def kill_group(pgid: int, grace_s: float = GRACE_S, reap=None) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after ``grace_s`` seconds (at once when
    ``grace_s`` is 0). ``reap`` (the leader's ``Popen.poll``) collects the leader once it exits, so
    that its zombie does not count as a live member."""
    if grace_s > 0:
        if not _signal_group(pgid, signal.SIGTERM):
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if reap is not None:
                reap()
            if not group_alive(pgid):
                return
            time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (a zombie not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_children_on_signal() -> None:
    """On SIGTERM or SIGINT (the caller's own time-out), kill every live child's group, then exit: a
    child in a session of its own would otherwise outlive this process."""

    def handler(signum, frame):  # noqa: ARG001
        for child in list(_live):
            kill_group(child.proc.pid, grace_s=1.0, reap=child.proc.poll)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def run_bounded(
    cmd: list[str], timeout_s: float, *, env: dict | None = None, cwd: str | Path | None = None, log: Path | None = None
) -> Finished:
    """Run ``cmd`` to its end or ``timeout_s``; a missing program is a Finished with returncode 127."""
    try:
        child = Child(cmd, log=log, env=env, cwd=cwd)
    except OSError as e:
        return Finished(127, False, 0.0, f"{cmd[0]}: {e}")
    return child.wait(timeout_s)


def _tail(path: Path | None, chars: int = 20_000) -> str:
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]
