"""The floor for front-end cost: a minimal Starlette app that reads the body and answers a fixed
512-float JSON embedding, as clipserve answers one image. Run by bench/frontend's cost section
as `uvicorn bench.frontend.floor:app --http httptools` (uvloop where installed)."""

from __future__ import annotations

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

_EMBEDDING = np.random.default_rng(0).standard_normal(512).astype(np.float32)
ANSWER = orjson.dumps(
    {"embedding": _EMBEDDING, "model": "floor", "dim": 512}, option=orjson.OPT_SERIALIZE_NUMPY
)


async def embed(request: Request) -> Response:
    await request.body()
    return Response(ANSWER, media_type="application/json")


async def ready(request: Request) -> Response:
    return Response(b"ok")


app = Starlette(routes=[Route("/embed", embed, methods=["POST"]), Route("/readyz", ready)])
