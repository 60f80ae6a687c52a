"""What the client raises: one class per failure a caller handles differently.

`InvalidInput` is the caller's data (fix or skip the item); `Overloaded` and `RequestTimedOut`
are the service's load (back off, raise the timeout); `ServerGone` is the service itself (auto
mode falls back to local on it). None of them carries httpx types.
"""

from __future__ import annotations


class ClientError(Exception):
    """Base of everything the client raises for a failed embedding call."""


class InvalidInput(ClientError):
    """One input could not be embedded: unreadable, undecodable, over a limit. `index` is its
    place in the caller's sequence, `source` its path (or "<bytes #i>", "<array #i>",
    "<text #i>"), `message` why."""

    def __init__(self, index: int, source: str, message: str) -> None:
        super().__init__(f"{source} (input {index}): {message}")
        self.index = index
        self.source = source
        self.message = message


class Overloaded(ClientError):
    """The service kept answering 503 overloaded or 429 rate limited, retries spent."""


class RequestTimedOut(ClientError):
    """A request outlived its deadline: the server answered 504 (or 408: the body reached it too
    slowly), or no answer came in time."""


class ServerGone(ClientError):
    """No service to talk to, retries spent: connection refused or reset, or it is not ready
    (no live worker, shutting down)."""


class Unauthorized(ClientError):
    """The service wants an API key and this one (or none) is not one of its keys (401)."""


class ServerError(ClientError):
    """Any other refusal: a 500, or an answer this client does not expect. `status` and
    `code` are the server's; status 0 with code "unreadable_answer" where httpx could not read
    the answer at all (a body that does not decode as its Content-Encoding says)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
