"""Ctrl-C (SIGINT) and SIGTERM in the grader's processes: delivered once, and never between the
fork of a child and the `try` whose `finally` stops it.

An interrupt that lands inside `Process.start()`, after the fork but before the caller holds the
child, leaves a child no clean-up knows of: the grader then prints "interrupted" and waits at exit
for that child to run to its time limit. So children are started with both signals held
(`interrupts_deferred`); a held signal is delivered as the block ends, inside the caller's `try`.
A child inherits the held mask and lets the signals through itself (`let_interrupts_through`) once
its own handlers are in place.
"""
from __future__ import annotations

import contextlib
import signal

INTERRUPTS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def interrupts_deferred():
    """SIGINT and SIGTERM wait until the block ends (use it inside the `try` that cleans up)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def let_interrupts_through() -> None:
    """In a child started under `interrupts_deferred`, after installing its handlers."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)


def _ignore(signum, frame) -> None:
    """Ignored, by a handler rather than SIG_IGN: a signal already pending when the handler changes to
    SIG_IGN makes Python print "Signal 15 ignored due to race condition" to the terminal."""


def raise_interrupt_once(signum, frame):
    """A handler: the first SIGINT or SIGTERM unwinds as KeyboardInterrupt; later ones (a second
    Ctrl-C, the class process's SIGTERM after the Ctrl-C its workers also got) are ignored, so they
    cannot cut the clean-up short or print a traceback from inside it."""
    for interrupt in INTERRUPTS:
        if signal.getsignal(interrupt) is not signal.SIG_IGN:  # one ignored from the start stays so
            signal.signal(interrupt, _ignore)
    raise KeyboardInterrupt
