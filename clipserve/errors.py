"""Domain errors. They carry no HTTP types: `http/status.py` maps each to a status code once."""

from __future__ import annotations

import copy


class ClipserveError(Exception):
    """Base of every error a client may see; `code` is the stable machine-readable name."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidImage(ClipserveError):
    code = "invalid_image"


class ImageUrlRefused(InvalidImage):
    """An image given as a URL: never fetched, and never embedded as the text it is."""

    code = "image_url_not_fetched"


class ImageUrlForbidden(InvalidImage):
    """An image URL --allow-url-fetch does not allow: its host, or a non-public address."""

    code = "image_url_refused"


class ImageFetchFailed(InvalidImage):
    """An allowed image URL that could not be fetched: refused, timed out, not an image."""

    code = "image_fetch_failed"


class InvalidTensor(ClipserveError):
    code = "invalid_tensor"


class InvalidBody(ClipserveError):
    """The body does not parse as its Content-Type says, or lacks the fields it needs."""

    code = "invalid_body"


class InvalidText(ClipserveError):
    code = "invalid_text"


class TextTooLong(ClipserveError):
    code = "text_too_long"


class TooManyTexts(ClipserveError):
    code = "too_many_texts"


class InvalidParameter(ClipserveError):
    code = "invalid_parameter"


class ModelNotFound(ClipserveError):
    """A request named a model this server does not serve (OpenAI and KServe routes)."""

    code = "model_not_found"


class PayloadTooLarge(ClipserveError):
    code = "payload_too_large"


class ImageTooLarge(ClipserveError):
    code = "image_too_large"


class TooManyItems(ClipserveError):
    code = "too_many_items"


class UnsupportedMediaType(ClipserveError):
    code = "unsupported_media_type"


class NotAcceptable(ClipserveError):
    code = "not_acceptable"


class Unsupported(ClipserveError):
    """A part of Triton's protocol clipserve does not serve (classification, CUDA shared
    memory, model control): gRPC's UNIMPLEMENTED, HTTP's 400, as Triton answers them."""

    code = "unsupported"


class Overloaded(ClipserveError):
    """The bounded queue is full; the client should retry after `retry_after_s`."""

    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unauthorized(ClipserveError):
    """No API key, or not one of --api-keys (answered with `WWW-Authenticate: Bearer`)."""

    code = "invalid_api_key"  # OpenAI's code for the same answer


class RateLimited(ClipserveError):
    """The key's quota (--rate-limit, or its line in --api-keys) is used up for now; the
    client should retry after `retry_after_s`."""

    code = "rate_limit_exceeded"  # OpenAI's

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidHeader(ClipserveError):
    code = "invalid_header"


class NotReady(ClipserveError):
    """No worker can take the request now; the client should retry after `retry_after_s`."""

    code = "not_ready"
    retry_after_s = 5


class ShuttingDown(NotReady):
    """The drain timeout expired before this request finished; another replica can answer."""

    code = "shutting_down"
    retry_after_s = 1


class RequestTimeout(ClipserveError):
    code = "timeout"


class BodyTimeout(RequestTimeout):
    """The request's body did not arrive within its deadline: the client's delay, not the
    server's: RFC 9110's 408 (nginx logs a timed-out body read as 408 too), where a 5xx would
    page on-call for a slow or stalled client."""

    code = "body_timeout"


class ExecutorFailed(ClipserveError):
    """The executor raised while running a batch; the detail is logged, never sent."""

    code = "internal"


class NonFiniteEmbedding(ClipserveError):
    """The model's output for this input holds NaN or infinity: refused, never sent as 200."""

    code = "non_finite_embedding"


class ExecutorFatal(Exception):
    """Raised by an executor whose device can no longer serve (device lost, context corrupt).

    The worker that sees it fails its batch and stops; `/readyz` then reports not ready. GPU
    executors raise it for sticky CUDA errors, never for out-of-memory
    (`backends/device.py: is_fatal_device_error`).
    """


class StartupError(Exception):
    """Configuration or loading failed; the CLI prints the message as one line and exits 2."""


class ConfigError(StartupError):
    pass


def with_item_index(error: ClipserveError, index: int) -> ClipserveError:
    """The same error, its message prefixed with the position of the bad item in a list."""
    located = copy.copy(error)
    located.message = f"item {index}: {error.message}"
    located.args = (located.message,)
    return located
