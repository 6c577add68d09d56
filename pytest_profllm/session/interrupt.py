"""SIGTERM, which CI runners send on cancel and timeout, handled as Ctrl-C is.

pytest turns Ctrl-C (KeyboardInterrupt) into an orderly stop: the summary is printed, every
`pytest_sessionfinish` runs (servers stopped, leases released, records loaded) and the exit
status is 2 (interrupted). Python's default for SIGTERM is to die at once, with none of that.
So every process of the session raises KeyboardInterrupt on SIGTERM; an xdist controller,
which runs no case, passes the signal on to its workers and lets xdist stop the session as it
does when a worker is interrupted (the records the workers already sent are kept). A second
SIGTERM to the controller stops it at once, in the same orderly way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

import psutil

SIGNAL_NAME = "SIGTERM"


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM, so pytest stops as it does on Ctrl-C."""


def install(
    on_signal: Callable[[], None],
    is_controller: Callable[[], bool],
) -> Callable[[], None] | None:
    """Handle SIGTERM in this process; returns what puts the previous handler back, or None
    where no handler can be set (not the main thread). `on_signal` is called once, first;
    `is_controller` says, at signal time, whether this process only drives xdist workers."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    received = False

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        first = not received
        received = True
        if first:
            on_signal()
        if first and is_controller() and _forward_to_workers():
            return  # xdist stops the session once its workers report the interruption
        # During the orderly stop, further SIGTERMs must not cut it short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(f"{SIGNAL_NAME} received: stopped as on Ctrl-C")

    signal.signal(signal.SIGTERM, handle)

    def restore() -> None:
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGTERM, previous)

    return restore


def _forward_to_workers() -> bool:
    """SIGTERM to this process's children (an xdist controller's children are its workers);
    whether there was any."""
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return False
    sent = False
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child.pid, signal.SIGTERM)
            sent = True
    return sent
