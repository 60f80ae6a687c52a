"""The Open Inference Protocol (KServe v2) over gRPC, as Triton serves it: ModelInferRequest
bytes → images, tensors or texts, and embeddings → ModelInferResponse bytes. Pure: no grpc.

The message classes are the ones `tritonclient[grpc]` ships (Triton's published protos), so
server and clients read one copy. An input's data comes as `raw_input_contents` (Triton's
layout: BYTES elements 4-byte length-prefixed, numbers little-endian), as typed `contents`
(`bytes_contents` one element per item, `uint_contents`, `fp32_contents`; FP16 has none), or
from a registered system shared-memory region. Once the input is an `InputTensor`, the checks
and errors are the HTTP codec's (`kserve.read_input`), word for word.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Sized
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from clipserve.errors import InvalidBody, InvalidTensor, TooManyItems, Unsupported
from clipserve.protocol.kserve import (
    DTYPES,
    VERSION,
    InferRequest,
    RequestedOutput,
    output_types,
    read_input,
    serialize_bytes,
)
from clipserve.protocol.kserve_inputs import InputTensor, SharedInput
from clipserve.protocol.shm import (
    BYTE_SIZE,
    OFFSET,
    REGION,
    ReadRegion,
    WriteRegion,
    region_ref,
)

if TYPE_CHECKING:
    from clipserve.batching.tower import TowerKind


def parameters(params: Mapping[str, pb.InferParameter]) -> dict[str, object]:
    """An `InferParameter` map as plain Python values (as HTTP's JSON gives them)."""
    values: dict[str, object] = {}
    for key, param in params.items():
        choice = param.WhichOneof("parameter_choice")
        values[key] = None if choice is None else getattr(param, choice)
    return values


def _typed(
    datatype: str, contents: pb.InferTensorContents, what: str, shape: list[int], cap: int
) -> bytes:
    """Typed `contents` as the bytes raw contents would hold. Counted before anything is
    built from them: a 32 MiB message holds 16M empty `bytes_contents`, each a Python object
    (~3 GB) before the shape could refuse them. `cap`: the most elements a request may hold."""
    fields: dict[str, Sized] = {
        "BYTES": contents.bytes_contents,
        "UINT8": contents.uint_contents,
        "FP32": contents.fp32_contents,
    }
    field = fields.get(datatype)
    if field is None:
        raise InvalidTensor(f"{what}: {datatype} data must come as raw_input_contents")
    n, need = len(field), math.prod(max(d, 0) for d in shape)  # len() builds nothing
    if n > need:
        raise InvalidTensor(f"{what}: contents hold {n} elements; shape {shape} needs {need}")
    if n > cap:  # as many as its shape says, more than a request may hold
        if datatype == "BYTES":
            raise TooManyItems(
                f"{what}: {n} items in one request; the limit is {cap} (--max-items-per-request)"
            )
        raise InvalidTensor(
            f"{what}: contents hold {n} values, more than --max-items-per-request inputs of "
            "the model's size"
        )
    if datatype == "BYTES":
        return serialize_bytes(list(contents.bytes_contents))
    if datatype == "UINT8":
        values = np.asarray(contents.uint_contents, dtype=np.uint64)
        if values.size and values.max() > 255:
            raise InvalidTensor(f"{what}: uint_contents of a UINT8 input must be within 0..255")
        return values.astype(np.uint8).tobytes()
    return np.asarray(contents.fp32_contents, dtype="<f4").tobytes()


def _outputs(message: pb.ModelInferRequest, output: str) -> list[RequestedOutput]:
    types = output_types(output)
    if not message.outputs:  # none named: the FP32 embedding
        return [RequestedOutput(output, types[output], True)]
    outputs: list[RequestedOutput] = []
    for spec in message.outputs:
        name = spec.name
        if name not in types:
            raise InvalidTensor(
                f"unexpected inference output {name!r}; the outputs are {', '.join(types)}"
            )
        if any(o.name == name for o in outputs):
            raise InvalidTensor(f"output {name!r} requested twice")
        params = parameters(spec.parameters)
        if "classification" in params:
            raise Unsupported(f"output {name!r}: classification is not supported")
        region = region_ref(params, f"output {name!r}")
        outputs.append(RequestedOutput(name, types[name], True, region))
    return outputs


def parse_model_infer(
    body: bytes,
    *,
    tower: TowerKind,
    datatype: str | None,
    size: tuple[int, int],
    max_items: int,
    max_text_chars: int,
    output: str,
    truncate: bool = False,
    read_region: ReadRegion | None = None,
    max_shared_bytes: int = 0,
) -> InferRequest:
    """Validate a serialized ModelInferRequest for the image or text model (the HTTP codec's
    `parse_infer_request`, over gRPC); `datatype`: a per-kind model's one input datatype. A
    region is read only once its size is checked (a BYTES input's at most
    `max_shared_bytes`, the door's --max-body-bytes)."""
    try:
        message = pb.ModelInferRequest.FromString(body)
    except DecodeError:
        raise InvalidBody("malformed ModelInferRequest (not a protobuf message)") from None
    if len(message.inputs) != 1:
        raise InvalidBody(
            f"a request must hold exactly one input tensor; got {len(message.inputs)}"
        )
    spec = message.inputs[0]
    what = f"input {spec.name!r}"
    params = parameters(spec.parameters)
    ref = region_ref(params, what)
    raw_count = len(message.raw_input_contents)
    shared: SharedInput | None = None
    raw = b""
    if ref is not None:
        if read_region is None:
            raise InvalidTensor(f"{what}: shared memory is not served here")
        if raw_count or spec.HasField("contents"):  # as over HTTP: which data would it be?
            raise InvalidBody(f"{what} is in shared memory, but the request carries its data too")
        shared = SharedInput(ref, read_region, max_shared_bytes)
        suffix = "-shm"
    elif raw_count:
        if raw_count != 1:
            raise InvalidBody(f"raw_input_contents holds {raw_count} tensors; the input is one")
        if spec.HasField("contents"):  # which data would it be? (as with shared memory)
            raise InvalidBody(f"{what} carries its data twice: raw_input_contents and contents")
        raw = message.raw_input_contents[0]
        suffix = ""
    elif spec.HasField("contents"):
        shape = [int(d) for d in spec.shape]
        per_item = 1 if spec.datatype == "BYTES" else 3 * size[0] * size[1]
        raw = _typed(spec.datatype, spec.contents, what, shape, max_items * per_item)
        suffix = "-typed"
    else:
        raise InvalidBody(f"{what} has no data: neither raw_input_contents nor contents")
    shape = [int(d) for d in spec.shape]
    tensor = InputTensor(
        {"name": spec.name, "datatype": spec.datatype, "shape": shape},
        memoryview(raw) if shared is None else None,
        shared,
    )
    request = InferRequest("", _outputs(message, output), message.id or None)
    return read_input(
        request,
        tensor,
        "grpc",
        suffix,
        tower=tower,
        datatype=datatype,
        size=size,
        max_items=max_items,
        max_text_chars=max_text_chars,
        truncate=truncate,
    )


def encode_model_infer(
    embeddings: np.ndarray,
    *,
    model_name: str,
    request_id: str | None,
    outputs: Sequence[RequestedOutput],
    write_region: WriteRegion | None = None,
) -> bytes:
    """A serialized ModelInferResponse: one `raw_output_contents` entry per output, in order,
    empty for an output written into its shared-memory region (as Triton answers: Triton's
    perf_analyzer reads an entry per output and crashes without one)."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=VERSION)
    if request_id:
        response.id = request_id
    for output in outputs:
        values = embeddings.astype(DTYPES[output.datatype], copy=False)
        tensor = response.outputs.add(
            name=output.name, datatype=output.datatype, shape=list(values.shape)
        )
        data = values.tobytes()
        if output.region is None:
            response.raw_output_contents.append(data)
            continue
        if write_region is None:
            raise InvalidTensor(f"output {output.name!r}: shared memory is not served here")
        write_region(output.region, data)
        tensor.parameters[REGION].string_param = output.region.name
        tensor.parameters[BYTE_SIZE].int64_param = len(data)
        if output.region.offset:
            tensor.parameters[OFFSET].int64_param = output.region.offset
        response.raw_output_contents.append(b"")
    return response.SerializeToString()
