"""The Python client: CLIP embeddings from a clipserve service (`remote`), from the same model
in-process (`local`), or from the service with the local model as fallback (`auto`).

    from clipserve.client import Client
    with Client("http://127.0.0.1:8000") as client:
        vectors = client.embed_images(["a.jpg", "b.png"])   # float32 (2, D), L2-normalised

`Client` is synchronous, `AsyncClient` the same API with `async def`. Modules: errors.py (what
it raises), inputs.py (what it takes), remote.py / local.py / auto.py (the three ways to
embed a batch), async_client.py and sync_client.py (the two front ends).
"""

from clipserve.client.async_client import AsyncClient
from clipserve.client.engine import Embedded
from clipserve.client.errors import (
    ClientError,
    InvalidInput,
    Overloaded,
    RequestTimedOut,
    ServerError,
    ServerGone,
    Unauthorized,
)
from clipserve.client.inputs import ImageInput
from clipserve.client.sync_client import Client

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "Embedded",
    "ImageInput",
    "InvalidInput",
    "Overloaded",
    "RequestTimedOut",
    "ServerError",
    "ServerGone",
    "Unauthorized",
]
