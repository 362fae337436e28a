"""Telling an interrupt from a failure: was an exception raised by a signal handler?

Where asynccache turns whatever an operation raised into a failure it can handle (bytes
that do not unpickle become a miss, a provider's bug a store error), an exception a signal
handler raised at that moment (a training framework's SIGTERM handler, a test harness's
SIGALRM timeout) would be taken for that failure and lost: the caller's interrupt must
reach the caller unchanged instead. ``KeyboardInterrupt`` is a ``BaseException`` and is
never caught there; other handlers raise ordinary exceptions, recognised here by the
handler's code on the exception's traceback. Only asked on an exception path.
"""

from __future__ import annotations

import signal
import threading
from types import CodeType

__all__ = ["raised_in_signal_handler"]


def _handler_codes() -> set[CodeType]:
    codes = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if handler is None or isinstance(handler, int):  # SIG_DFL, SIG_IGN, not Python's
            continue
        for _ in range(4):  # a function, or what wraps one: a bound method, a partial
            code = getattr(handler, "__code__", None)
            if code is not None:
                codes.add(code)
                break
            handler = (getattr(handler, "__func__", None) or getattr(handler, "func", None)
                       or vars(type(handler)).get("__call__"))
            if handler is None:
                break
    return codes


def raised_in_signal_handler(exc: BaseException) -> bool:
    """True when ``exc`` was raised by (or below) a Python signal handler: the interrupt
    of the code that caught it, not that code's failure."""
    if threading.current_thread() is not threading.main_thread():
        return False  # Python runs signal handlers in the main thread only
    tb = exc.__traceback__
    if tb is None:
        return False
    codes = _handler_codes()
    if not codes:
        return False
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False
