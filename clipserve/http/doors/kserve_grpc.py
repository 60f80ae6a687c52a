"""Triton's gRPC service over the same pipeline, names, health and limits as the KServe v2
HTTP door (http/doors/kserve.py): the servicer `http/grpc_server.py` serves.

A ModelInfer message arrives as bytes. Only its model name and version are read before
admission (`peek_model`: a walk over the message's top-level fields, nothing copied); the
message is parsed in the decode pool once the request holds its place in the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Generic

from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb

from clipserve import __version__
from clipserve.batching.tower import TicketT, TowerKind
from clipserve.config import LimitsConfig
from clipserve.errors import InvalidBody, PayloadTooLarge, Unsupported
from clipserve.http import health, stats
from clipserve.http.cache_keys import reads_cache
from clipserve.http.doors.kserve import serving_of, work_of
from clipserve.http.doors.kserve_shm import CUDA_UNSUPPORTED
from clipserve.http.grpc_server import Context, Methods, call_span
from clipserve.http.names import KServeModel, resolve_model
from clipserve.http.pipeline import Pipeline, Serving
from clipserve.http.request import BodyBudget, RequestContext
from clipserve.http.timing import StageTimer
from clipserve.http.work import Embedded, Encoded, Work
from clipserve.protocol import kserve as codec
from clipserve.protocol import kserve_grpc as grpc_codec
from clipserve.protocol import triton_model
from clipserve.protocol.kserve import InferRequest
from clipserve.protocol.shm import FitRegion, ReadRegion, WriteRegion


def _varint(body: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while at < len(body) and shift < 64:
        byte = body[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
    raise InvalidBody("malformed ModelInferRequest: a varint runs past the message")


def peek_model(body: bytes) -> tuple[str, str]:
    """ModelInferRequest's `model_name` (field 1) and `model_version` (field 2), read off the
    wire format without parsing the rest; InvalidBody if the fields around them are broken."""
    found: dict[int, str] = {}
    at = 0
    while at < len(body) and len(found) < 2:
        tag, at = _varint(body, at)
        field, wire = tag >> 3, tag & 7
        if wire == 2:  # length-delimited: every field of this message
            length, at = _varint(body, at)
            if at + length > len(body):
                raise InvalidBody("malformed ModelInferRequest: a field runs past the message")
            if field in (1, 2):
                try:
                    found[field] = body[at : at + length].decode()
                except UnicodeDecodeError:
                    problem = "malformed ModelInferRequest: the model's name is not UTF-8"
                    raise InvalidBody(problem) from None
            at += length
        elif wire == 0:
            _, at = _varint(body, at)
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise InvalidBody(f"malformed ModelInferRequest: wire type {wire}")
    return found.get(1, ""), found.get(2, "")


class GrpcExchange:
    """A ModelInfer call as the pipeline sees it: the deadline the client set, the message
    (received whole by gRPC within --max-body-bytes), and no disconnect watch: gRPC cancels the
    handler itself when the client cancels or its deadline passes."""

    deadline_name = "the gRPC deadline"

    def __init__(self, context: Context[bytes, bytes], request_id: str, message: bytes) -> None:
        self.context = context
        self.request_id = request_id
        self.timer = StageTimer()
        self.message = message
        self.items = 0
        metadata = context.invocation_metadata() or ()
        self.fresh = not reads_cache(
            v for k, v in metadata if k == "cache-control" and isinstance(v, str)
        )

    def timeout_s(self, server_s: float) -> float:
        remaining = self.context.time_remaining()
        return server_s if remaining is None else max(0.0, min(remaining, server_s))

    async def body(self, limit: int, budget: BodyBudget, ctx: RequestContext) -> bytes:
        if len(self.message) > limit:  # gRPC refuses these first: kept for a changed option
            raise PayloadTooLarge(f"message exceeds {limit} bytes (--max-body-bytes)")
        budget.reserve(len(self.message))
        ctx.reserved_bytes += len(self.message)
        return self.message

    async def gone(self) -> None:
        await asyncio.Event().wait()

    def note_items(self, n: int) -> None:
        self.items = n


@dataclass(frozen=True)
class GrpcInfer:
    """ModelInfer for one model: parsed in the pool, answered as ModelInferResponse bytes."""

    runtime: Serving
    name: str
    model: KServeModel
    limits: LimitsConfig
    output: str
    read_region: ReadRegion | None = None
    write_region: WriteRegion | None = None
    fit_region: FitRegion | None = None
    inline: bool = False

    @property
    def tower(self) -> TowerKind:
        return self.model.tower

    def parse(self, body: bytes) -> Work[InferRequest]:
        parsed = grpc_codec.parse_model_infer(
            body,
            tower=self.tower,
            datatype=self.model.datatype,
            size=self.runtime.model.preprocess.size,
            max_items=self.limits.max_items_per_request,
            max_text_chars=self.limits.max_text_chars,
            output=self.output,
            truncate=self.limits.truncate_text,
            read_region=self.read_region,
            max_shared_bytes=self.limits.max_body_bytes,
        )
        return work_of(parsed, self.tower, self.runtime, self.limits, self.fit_region)

    def encode(self, work: Work[InferRequest], done: Embedded) -> Encoded:
        completed = done.texts if self.tower == "text" else done.images
        assert completed is not None
        content = grpc_codec.encode_model_infer(
            completed.embeddings,
            model_name=self.name,
            request_id=work.parsed.id,
            outputs=work.parsed.outputs,
            write_region=self.write_region,
        )
        return Encoded(content, "application/grpc")


class InferenceServicer(Generic[TicketT]):
    """Every method of Triton's service clipserve serves; `grpc_server.build_grpc_server`
    wraps each (request id, keys, metrics, errors as gRPC statuses)."""

    def __init__(self, pipeline: Pipeline[TicketT]) -> None:
        self.pipeline = pipeline
        self.traced = False  # whether the guard traces calls (--otel-endpoint)

    def register(self, methods: Methods) -> None:
        """Each method under its own name, with Triton's message types for it."""
        m = methods
        self.traced = m.guard.tracing is not None
        m.unary(self.ServerLive, pb.ServerLiveRequest, pb.ServerLiveResponse)
        m.unary(self.ServerReady, pb.ServerReadyRequest, pb.ServerReadyResponse)
        m.unary(self.ModelReady, pb.ModelReadyRequest, pb.ModelReadyResponse)
        m.unary(self.ServerMetadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse)
        m.unary(self.ModelMetadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse)
        m.raw(self.ModelInfer)  # bytes: parsed in the decode pool, after admission
        m.unary(self.ModelConfig, pb.ModelConfigRequest, pb.ModelConfigResponse)
        m.unary(self.ModelStatistics, pb.ModelStatisticsRequest, pb.ModelStatisticsResponse)
        m.unary(self.RepositoryIndex, pb.RepositoryIndexRequest, pb.RepositoryIndexResponse)
        m.unary(
            self.SystemSharedMemoryRegister,
            pb.SystemSharedMemoryRegisterRequest,
            pb.SystemSharedMemoryRegisterResponse,
        )
        m.unary(
            self.SystemSharedMemoryStatus,
            pb.SystemSharedMemoryStatusRequest,
            pb.SystemSharedMemoryStatusResponse,
        )
        m.unary(
            self.SystemSharedMemoryUnregister,
            pb.SystemSharedMemoryUnregisterRequest,
            pb.SystemSharedMemoryUnregisterResponse,
        )
        m.unary(
            self.CudaSharedMemoryRegister,
            pb.CudaSharedMemoryRegisterRequest,
            pb.CudaSharedMemoryRegisterResponse,
        )
        m.unary(
            self.CudaSharedMemoryStatus,
            pb.CudaSharedMemoryStatusRequest,
            pb.CudaSharedMemoryStatusResponse,
        )
        m.unary(
            self.CudaSharedMemoryUnregister,
            pb.CudaSharedMemoryUnregisterRequest,
            pb.CudaSharedMemoryUnregisterResponse,
        )

    def _model(self, name: str, version: str) -> tuple[str, KServeModel]:
        return resolve_model(self.pipeline.names, name, version)

    async def ServerLive(
        self,
        request: pb.ServerLiveRequest,
        context: Context[pb.ServerLiveRequest, pb.ServerLiveResponse],
        rid: str,
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=health.liveness(self.pipeline.towers).ok)

    async def ServerReady(
        self,
        request: pb.ServerReadyRequest,
        context: Context[pb.ServerReadyRequest, pb.ServerReadyResponse],
        rid: str,
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.pipeline.readiness().ok)

    async def ModelReady(
        self,
        request: pb.ModelReadyRequest,
        context: Context[pb.ModelReadyRequest, pb.ModelReadyResponse],
        rid: str,
    ) -> pb.ModelReadyResponse:
        _, model = self._model(request.name, request.version)
        ready = health.tower_ready(self.pipeline.towers[model.tower])
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(
        self,
        request: pb.ServerMetadataRequest,
        context: Context[pb.ServerMetadataRequest, pb.ServerMetadataResponse],
        rid: str,
    ) -> pb.ServerMetadataResponse:
        doc = codec.server_metadata()
        return pb.ServerMetadataResponse(
            name=doc["name"], version=__version__, extensions=doc["extensions"]
        )

    async def ModelMetadata(
        self,
        request: pb.ModelMetadataRequest,
        context: Context[pb.ModelMetadataRequest, pb.ModelMetadataResponse],
        rid: str,
    ) -> pb.ModelMetadataResponse:
        name, model = self._model(request.name, request.version)
        doc = codec.model_metadata(name, model, *self._shape())
        return json_format.ParseDict(doc, pb.ModelMetadataResponse())

    def _shape(self) -> tuple[tuple[int, int], int, str]:
        model = self.pipeline.runtime.model
        return model.preprocess.size, model.embed_dim, self.pipeline.names.output

    async def ModelConfig(
        self,
        request: pb.ModelConfigRequest,
        context: Context[pb.ModelConfigRequest, pb.ModelConfigResponse],
        rid: str,
    ) -> pb.ModelConfigResponse:
        name, model = self._model(request.name, request.version)
        config = triton_model.model_config(name, model, serving_of(self.pipeline))
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(
        self,
        request: pb.ModelStatisticsRequest,
        context: Context[pb.ModelStatisticsRequest, pb.ModelStatisticsResponse],
        rid: str,
    ) -> pb.ModelStatisticsResponse:
        if request.name:
            name, model = self._model(request.name, request.version)
            models = [(name, model.tower)]
        else:
            models = [(n, m.tower) for n, m in self.pipeline.names.kserve_models().items()]
        return stats.model_statistics(self.pipeline.metrics, models)

    async def RepositoryIndex(
        self,
        request: pb.RepositoryIndexRequest,
        context: Context[pb.RepositoryIndexRequest, pb.RepositoryIndexResponse],
        rid: str,
    ) -> pb.RepositoryIndexResponse:
        towers = self.pipeline.towers
        ready = {kind: health.tower_ready(tower) for kind, tower in towers.items()}
        models = {n: ready[m.tower] for n, m in self.pipeline.names.kserve_models().items()}
        return json_format.ParseDict(
            {"models": codec.repository_index(models)}, pb.RepositoryIndexResponse()
        )

    async def SystemSharedMemoryRegister(
        self,
        request: pb.SystemSharedMemoryRegisterRequest,
        context: Context[
            pb.SystemSharedMemoryRegisterRequest, pb.SystemSharedMemoryRegisterResponse
        ],
        rid: str,
    ) -> pb.SystemSharedMemoryRegisterResponse:
        regions = self.pipeline.regions
        regions.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryStatus(
        self,
        request: pb.SystemSharedMemoryStatusRequest,
        context: Context[pb.SystemSharedMemoryStatusRequest, pb.SystemSharedMemoryStatusResponse],
        rid: str,
    ) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.pipeline.regions.status(request.name or None):
            response.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**dataclasses.asdict(region))
            )
        return response

    async def SystemSharedMemoryUnregister(
        self,
        request: pb.SystemSharedMemoryUnregisterRequest,
        context: Context[
            pb.SystemSharedMemoryUnregisterRequest, pb.SystemSharedMemoryUnregisterResponse
        ],
        rid: str,
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self.pipeline.regions.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryRegister(
        self,
        request: pb.CudaSharedMemoryRegisterRequest,
        context: Context[pb.CudaSharedMemoryRegisterRequest, pb.CudaSharedMemoryRegisterResponse],
        rid: str,
    ) -> pb.CudaSharedMemoryRegisterResponse:
        raise Unsupported(CUDA_UNSUPPORTED)

    async def CudaSharedMemoryStatus(
        self,
        request: pb.CudaSharedMemoryStatusRequest,
        context: Context[pb.CudaSharedMemoryStatusRequest, pb.CudaSharedMemoryStatusResponse],
        rid: str,
    ) -> pb.CudaSharedMemoryStatusResponse:
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryUnregister(
        self,
        request: pb.CudaSharedMemoryUnregisterRequest,
        context: Context[
            pb.CudaSharedMemoryUnregisterRequest, pb.CudaSharedMemoryUnregisterResponse
        ],
        rid: str,
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    async def ModelInfer(self, body: bytes, context: Context[bytes, bytes], rid: str) -> bytes:
        pipeline = self.pipeline
        name, model = self._model(*peek_model(body))
        limits, output, regions = pipeline.config.limits, pipeline.names.output, pipeline.regions
        call = GrpcInfer(
            pipeline.runtime, name, model, limits, output, regions.read, regions.write, regions.fits
        )
        exchange = GrpcExchange(context, rid, body)
        if self.traced and (span := call_span()) is not None:
            span.exchange = exchange  # the call's span gets its stages and items
        ctx, encoded = await pipeline.run(exchange, call)
        timing = ("server-timing", ctx.timer.header())
        context.set_trailing_metadata((("x-request-id", rid), timing))
        return encoded.content
