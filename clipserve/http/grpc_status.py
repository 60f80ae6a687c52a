"""Domain errors as gRPC statuses, the codes Triton's gRPC endpoint gives for the same faults
(its `grpc_utils.cc`): the counterpart of `status.STATUS`, walked the same way (by MRO).

Overload and not-ready are UNAVAILABLE with `retry-pushback-ms` in the trailing metadata, the
retry hint gRPC's own retry policy reads (HTTP's Retry-After); 500s stay opaque, as over HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import grpc

from clipserve import errors

CODES: dict[type[errors.ClipserveError], grpc.StatusCode] = {
    errors.InvalidImage: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidTensor: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidBody: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidText: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidHeader: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidParameter: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnsupportedMediaType: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotAcceptable: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NonFiniteEmbedding: grpc.StatusCode.INVALID_ARGUMENT,
    # Triton: a batch over max_batch_size is INVALID_ARGUMENT, not a size error.
    errors.TooManyItems: grpc.StatusCode.INVALID_ARGUMENT,
    errors.TooManyTexts: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ImageTooLarge: grpc.StatusCode.INVALID_ARGUMENT,
    errors.TextTooLong: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ModelNotFound: grpc.StatusCode.NOT_FOUND,
    errors.Overloaded: grpc.StatusCode.UNAVAILABLE,
    errors.NotReady: grpc.StatusCode.UNAVAILABLE,
    errors.RequestTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    # gRPC's own answer to an over-size message; a quota used up is the same kind of fault.
    errors.PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.RateLimited: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    errors.Unsupported: grpc.StatusCode.UNIMPLEMENTED,
}
RETRY_PUSHBACK = "retry-pushback-ms"


@runtime_checkable
class RetryLater(Protocol):
    """An error with a retry hint (Overloaded, RateLimited, NotReady, ...)."""

    retry_after_s: int


@dataclass(frozen=True)
class GrpcError:
    code: grpc.StatusCode
    message: str
    trailing_metadata: tuple[tuple[str, str], ...] = ()


def grpc_error(error: BaseException) -> GrpcError:
    """The status a client gets for `error`; anything not a domain error is INTERNAL,
    "internal error" (the detail is logged with the request id, never sent)."""
    if not isinstance(error, errors.ClipserveError):
        return GrpcError(grpc.StatusCode.INTERNAL, "internal error")
    code = next((CODES[c] for c in type(error).__mro__ if c in CODES), None)
    if code is None:
        return GrpcError(grpc.StatusCode.INTERNAL, "internal error")
    trailing: tuple[tuple[str, str], ...] = ()
    if isinstance(error, RetryLater):
        trailing = ((RETRY_PUSHBACK, str(int(error.retry_after_s * 1000))),)
    return GrpcError(code, error.message, trailing)
