"""What every process the supervisor starts does first: log with its role, and leave if the
supervisor dies (even by SIGKILL) rather than serve on unsupervised."""

from __future__ import annotations

import os
import signal
import threading
import time

from clipserve.logs import configure_logging


def start_child(log_level: str, role: str, parent_pid: int, log_format: str = "text") -> None:
    configure_logging(log_level, role=role, fmt=log_format)
    # A hangup is the supervisor's to pass on (a front end's app handles it once started, to
    # reload the key file); by default it would kill the process.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    watch_parent(parent_pid)


def watch_parent(parent_pid: int) -> None:
    """If the supervisor dies (even by SIGKILL), this process drains and exits rather than
    serve on unsupervised."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="clipserve-parent-watch", daemon=True).start()
