"""`tokensampler bench --contention N`: N busy processes beside the timed arms.

A laptop, a CI runner or a pod with a CPU quota rarely gives the sampler every core: a package
install, a test suite or the engine's own forward competes for them. `BusyProcesses` starts N
processes that each spin on one core while switched on; the bench times every round twice, once
quiet and once with the load switched on, in alternation, so the contended/quiet ratio of each arm
is measured side by side in one run.

Example::

    with BusyProcesses(1) as load:
        load.on()    # one core is now taken by a spinning process
        ...          # timed work
        load.off()   # the process is stopped (SIGSTOP): no CPU
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import TracebackType

_SETTLE_S = 0.05  # after switching the load on or off, before timing: the scheduler has acted by then
_SPIN = "while True: pass"  # a bare interpreter spinning: one core, no memory traffic, no imports


class BusyProcesses:
    """`n` spinning processes, switched on and off by `on()` / `off()` (off when started).

    Each is `python -c "while True: pass"`, stopped (SIGSTOP) while off and continued (SIGCONT)
    while on: no polling, no CPU at all while off. A context manager: the processes are started on
    entry and killed on exit, also when the body raises. `n = 0` is a valid no-op load.
    """

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"n={n}: the number of busy processes is an int >= 0")
        self.n = n
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> "BusyProcesses":
        for _ in range(self.n):
            self._procs.append(subprocess.Popen([sys.executable, "-S", "-c", _SPIN]))
        self.off()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()

    @property
    def pids(self) -> list[int]:
        """The processes' ids."""
        return [proc.pid for proc in self._procs]

    @property
    def alive(self) -> int:
        """How many of the processes are running (stopped ones included)."""
        return sum(proc.poll() is None for proc in self._procs)

    def _signal(self, sig: int) -> None:
        for proc in self._procs:
            os.kill(proc.pid, sig)
        if self._procs:
            time.sleep(_SETTLE_S)

    def on(self) -> None:
        """Switch the load on: every process spins on a core."""
        self._signal(signal.SIGCONT)

    def off(self) -> None:
        """Switch the load off: every process is stopped."""
        self._signal(signal.SIGSTOP)
