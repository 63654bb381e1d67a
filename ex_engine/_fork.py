"""Locks that a child made by os.fork gets anew (multiprocessing's 'fork' too).

A threading.Lock another thread of the parent held at the fork stays held in the child, where
no thread will ever release it: the child's first call that takes it waits forever (a registry
whose stats() lock a calling thread held: 15 of 100 forks hung, session thirty-nine). Each
holder of such locks (a module, a registry, a tuning table) names them once with
renew_after_fork; the one handler here replaces them all in the child.
"""
from __future__ import annotations

import os
import threading
import weakref

# holder (a module or an object, kept weakly) -> the names of its lock attributes
_HOLDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def renew_after_fork(holder, *names: str) -> None:
    """In a child made by os.fork, ``holder``'s attributes ``names`` become new, unheld
    threading.Locks (a module's globals too: pass the module). Held weakly: a holder gone
    before the fork is skipped."""
    _HOLDERS[holder] = tuple(names)


def _renew() -> None:
    for holder, names in list(_HOLDERS.items()):
        for name in names:
            setattr(holder, name, threading.Lock())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew)
