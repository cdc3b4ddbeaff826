"""The one hook that hears a key change, shared by WATCH and client-side caching.

Storage calls one plain callable, the keyspace's `touched` (and, in a cluster, the
directory's: a peer's log changed a key), with a key's full name after any change of it
(tiers/keyspace.py lists them). Two registries of the protocol want to hear those changes:
WATCH's (transactions.Watches) and CLIENT TRACKING's (tracking.Tracking), as redis's
signalModifiedKey feeds both touchWatchedKey and trackingInvalidateKey. `KeyChanges` is
the one place that sets the hook: to the only listener's own method while one listens (no
call in between), to `touched` here while both do, to None while nobody does (storage then
pays one test per change).

A listener is any object with a `touched(fk)` method.
"""

from __future__ import annotations

from typing import Any


class KeyChanges:
    def __init__(self) -> None:
        self.listeners: list[Any] = []
        self.keyspace: Any = None  # whose `touched` hook this sets, while anyone listens
        self.directory: Any = None  # ... and the cluster directory's

    def listen(self, listener: Any, keyspace: Any, directory: Any = None) -> None:
        """`listener.touched(fk)` hears every change of a key from now on (once, however often asked)."""
        if listener not in self.listeners:
            self.listeners.append(listener)
        self.keyspace = keyspace
        if directory is not None:
            self.directory = directory
        self._install()

    def unlisten(self, listener: Any) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)
            self._install()

    def touched(self, fk: bytes) -> None:
        """`fk` changed: every listener hears it (a listener may stop listening meanwhile)."""
        for listener in tuple(self.listeners):
            listener.touched(fk)

    def _install(self) -> None:
        listeners = self.listeners
        hook = None if not listeners else listeners[0].touched if len(listeners) == 1 else self.touched
        if self.keyspace is not None:
            self.keyspace.touched = hook
        if self.directory is not None:
            self.directory.touched = hook
        if hook is None:
            self.keyspace = self.directory = None
