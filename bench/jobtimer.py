"""job_timeout_s: one job's time limit, as an alarm in the job's process (its main thread, as
Hydra's launchers run jobs). JOB_TIMER says whether it went off, whatever code caught it."""
from __future__ import annotations

import signal

from .backend import EngineTimeout

JOB_TIMER = {"expired": False, "seconds": None}  # whether this job's alarm went off, whatever caught it


def start_job_timeout(seconds: float | None) -> None:
    """job_timeout_s: a job still running after this long is stopped with status=timeout (SIGALRM
    in the job's process: its main thread, as Hydra's launchers run jobs)."""
    JOB_TIMER.update(expired=False, seconds=seconds)
    if not seconds:
        return

    def expired(signum, frame):
        JOB_TIMER["expired"] = True
        raise EngineTimeout(f"the job ran past job_timeout_s={seconds:g} s")

    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))


def cancel_job_timeout() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
