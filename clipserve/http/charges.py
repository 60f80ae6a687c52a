"""One request's account under a rate limit: its grant and the tokens it has taken, in a
context variable while its handler runs (set by `http/access.py`'s guard, or the gRPC server's;
charged by its `MeteredTower`). The pipeline reaches it only to say a place went unused."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from clipserve.http.keys import Grant


@dataclass
class Charge:
    """One request's account: its grant, and the tokens it has taken so far."""

    grant: Grant
    taken: float = 0.0
    # Tokens of places it reserved and then had no use for: they pay for its next places.
    prepaid: float = 0.0


_CHARGE: contextvars.ContextVar[Charge | None] = contextvars.ContextVar(
    "clipserve_charge", default=None
)


@contextlib.contextmanager
def charging(grant: Grant) -> Iterator[None]:
    """The request's account while its handler runs: what `MeteredTower` charges (the gRPC
    door's counterpart of `AccessGuard`)."""
    token = _CHARGE.set(Charge(grant))
    try:
        yield
    finally:
        _CHARGE.reset(token)


def current_charge() -> Charge | None:
    """The running request's account (None: no rate limit or keys, or outside a request)."""
    return _CHARGE.get()


def refund_unused(n: int) -> None:
    """The request gave back `n` places it never used (an OpenAI request of images alone holds
    its first place, taken before its body is parsed, in the text tower): their tokens pay for
    its next places, so that every item costs one token, whatever door it came in by."""
    charge = _CHARGE.get()
    if charge is not None:
        charge.prepaid += n
