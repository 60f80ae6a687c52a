"""The Open Inference Protocol (KServe v2) as Triton serves it over HTTP: inference request
bodies → images, tensors or texts, and embeddings → response bodies. Pure: no Starlette.

Tensors come as JSON `data` or, with Triton's binary tensor extension, as raw bytes after the
JSON header (its length in `Inference-Header-Content-Length`, each tensor's in its
`binary_data_size` parameter). A BYTES element in binary is a 4-byte little-endian length and
the bytes; in JSON, where strings must be text, an encoded image is its base64. The input's
contents are read in `kserve_inputs.py`; this module reads and writes the rest.

The image model takes one input per request, told apart by its datatype: BYTES [N] or [N, 1]
(encoded JPEG/PNG/WebP), UINT8 [N, H, W, 3], or FP32/FP16 [N, 3, H, W] (normalised). Its name
is free: the datatype says what it holds, so a client that called it INPUT__0 on Triton keeps
working. The text model (`<model>-text`) takes BYTES [N] or [N, 1] of UTF-8 text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import orjson

from clipserve import __version__
from clipserve.errors import InvalidBody, InvalidTensor, TooManyItems, Unsupported
from clipserve.protocol.kserve_inputs import (
    LENGTH,
    NUMERIC,
    InputTensor,
    array_of,
    images_of,
    input_tensor,
    texts_of,
)
from clipserve.protocol.shm import ReadRegion, RegionRef, WriteRegion, region_ref

if TYPE_CHECKING:
    from clipserve.batching.tower import TowerKind


class ServedModel(Protocol):
    """A served model as the codec needs it (`http.names.KServeModel`)."""

    @property
    def tower(self) -> TowerKind: ...

    @property
    def datatype(self) -> str | None: ...


HEADER_LENGTH = "Inference-Header-Content-Length"
TEXT_SUFFIX = "-text"
VERSION = "1"  # one version per model; Triton's clients ask for "" or "1"
DEFAULT_OUTPUT = "embedding"  # --output-name
DTYPES = {"FP32": "<f4", "FP16": "<f2"}  # output datatype → little-endian numpy dtype
EXTENSIONS = (
    "binary_tensor_data",
    "model_repository",
    "model_configuration",
    "statistics",
    "system_shared_memory",
)


def output_types(output: str) -> dict[str, str]:
    """The outputs of either model, by name: `output` (--output-name) holds the FP32
    embedding, `output`_fp16 the same in FP16."""
    return {output: "FP32", output + "_fp16": "FP16"}


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    datatype: str
    binary: bool
    region: RegionRef | None = None  # written into this shared-memory region, not sent


@dataclass
class InferRequest:
    """One inference request: encoded images, a validated tensor, or texts."""

    protocol: str  # metrics label: kserve-bytes, kserve-uint8, kserve-fp32, kserve-text, ...
    outputs: list[RequestedOutput]
    id: str | None = None
    images: list[bytes] = field(default_factory=list)
    tensor: np.ndarray | None = None
    texts: list[str] = field(default_factory=list)
    shared_bytes: int = 0  # read from a shared-memory region into this process

    @property
    def count(self) -> int:
        if self.tensor is not None:
            return int(self.tensor.shape[0])
        return len(self.images) or len(self.texts)


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary tensor data after it (a view: tensors are not copied)."""
    if header_length is None:
        return body, memoryview(b"")
    raw = header_length.strip()
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19) or int(raw) > len(body):
        raise InvalidBody(
            f"{HEADER_LENGTH}: {header_length[:40]!r} is not a length within the "
            f"{len(body)}-byte body"
        )
    return body[: int(raw)], memoryview(body)[int(raw) :]


def _outputs(doc: dict[str, Any], output: str) -> list[RequestedOutput]:
    types = output_types(output)
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidBody('"parameters" must be an object')
    all_binary = _flag(params, "binary_data_output", False, "the request")
    requested = doc.get("outputs")
    if not requested:  # none named: the FP32 embedding (see model metadata for the FP16 one)
        return [RequestedOutput(output, types[output], all_binary)]
    if not isinstance(requested, list):
        raise InvalidBody('"outputs" must be an array')
    outputs: list[RequestedOutput] = []
    for spec in requested:
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or name not in types:
            raise InvalidTensor(
                f"unexpected inference output {name!r}; the outputs are {', '.join(types)}"
            )
        if any(o.name == name for o in outputs):
            raise InvalidTensor(f"output {name!r} requested twice")
        out_params = spec.get("parameters") or {}
        if not isinstance(out_params, dict):
            raise InvalidBody(f'output {name!r}: "parameters" must be an object')
        if "classification" in out_params:
            raise Unsupported(f"output {name!r}: classification is not supported")
        binary = _flag(out_params, "binary_data", all_binary, f"output {name!r}")
        region = region_ref(out_params, f"output {name!r}")
        outputs.append(RequestedOutput(name, types[name], binary, region))
    return outputs


def _flag(params: dict[str, Any], name: str, default: bool, what: str) -> bool:
    """A boolean parameter: "yes" or 1 is refused (as Triton does), not read as false."""
    value = params.get(name, default)
    if not isinstance(value, bool):
        raise InvalidTensor(
            f'{what}: parameter "{name}" must be true or false, not {value!r}'[:200]
        )
    return value


def _check_containers(header: bytes, max_items: int, size: tuple[int, int]) -> None:
    """Refuse before parsing a header holding more arrays and objects than the largest valid
    request nests (JSON data for [N, 3, H, W] is N·3·H rows): orjson turns 31 MiB of `[],`
    into 10 M lists (~0.9 GiB). Brackets inside strings only make the count stricter."""
    limit = max_items * (3 * max(size) + 8) + 64
    count = header.count(b"[") + header.count(b"{")
    if count > limit:
        raise TooManyItems(
            f"the inference header holds {count} arrays and objects; a request "
            f"of at most {max_items} items (--max-items-per-request) needs no "
            f"more than {limit}"
        )


# Strings a request's JSON may hold besides its BYTES items: keys, names, datatypes, ids and
# parameters (a client may send parameters the server ignores).
ENVELOPE_STRINGS = 1024


def _check_strings(header: bytes, max_items: int) -> None:
    """Refuse before parsing a header holding more strings than a request's items and its
    envelope: orjson makes an object of each, and 8 M one-character strings in 31 MiB came to
    ~0.7 GiB before the shape could refuse them. Escaped quotes are not counted."""
    plain = header.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in header else header
    strings = plain.count(b'"') // 2
    limit = max_items + ENVELOPE_STRINGS
    if strings > limit:
        raise TooManyItems(
            f"the inference header holds {strings} strings; a request of at most {max_items} "
            f"items (--max-items-per-request) needs no more than {limit}"
        )


def parse_infer_request(
    body: bytes,
    header_length: str | None,
    *,
    tower: TowerKind,
    size: tuple[int, int],
    max_items: int,
    max_text_chars: int,
    output: str = DEFAULT_OUTPUT,
    truncate: bool = False,
    datatype: str | None = None,
    read_region: ReadRegion | None = None,
    max_shared_bytes: int = 0,
) -> InferRequest:
    """Validate an inference request for the image or text model; `size` is the model's
    (height, width), `output` the FP32 output's name. Shapes and element counts are checked
    before any data is copied (or read from shared memory: a BYTES input there holds at most
    `max_shared_bytes`, the door's --max-body-bytes)."""
    header, binary = split_body(body, header_length)
    _check_containers(header, max_items, size)
    _check_strings(header, max_items)
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as e:
        raise InvalidBody(f"malformed JSON inference header ({e})") from None
    if not isinstance(doc, dict):
        raise InvalidBody("the inference request must be a JSON object")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidBody('"id" must be a string')
    outputs = _outputs(doc, output)
    tensor = input_tensor(doc, binary, read_region, max_shared_bytes=max_shared_bytes)
    suffix = "-shm" if tensor.shared is not None else "-json" if tensor.in_json else ""
    request = InferRequest("", outputs, request_id)
    return read_input(
        request,
        tensor,
        "kserve",
        suffix,
        tower=tower,
        datatype=datatype,
        size=size,
        max_items=max_items,
        max_text_chars=max_text_chars,
        truncate=truncate,
    )


def read_input(
    request: InferRequest,
    tensor: InputTensor,
    prefix: str,
    suffix: str,
    *,
    tower: TowerKind,
    datatype: str | None,
    size: tuple[int, int],
    max_items: int,
    max_text_chars: int,
    truncate: bool,
) -> InferRequest:
    """`request` with the input's images, tensor or texts, whichever protocol carried it
    (`prefix`-<datatype>`suffix` is its metrics label); `datatype`: the only one the model
    takes (a per-kind model), None for any of the tower's."""
    got = tensor.datatype
    if tensor.shared is not None:  # checked against the limits before any read
        request.shared_bytes = tensor.shared.ref.byte_size
    if datatype is not None and got != datatype:
        raise InvalidTensor(f"datatype {got}: this model takes {datatype} only")
    if tower == "text":
        if got != "BYTES":
            raise InvalidTensor(f"datatype {got}: the text model takes BYTES (UTF-8 text)")
        request.texts = texts_of(tensor, max_items, max_text_chars, truncate)
        request.protocol = f"{prefix}-text{suffix}"
    elif got == "BYTES":
        request.images = images_of(tensor, max_items)
        request.protocol = f"{prefix}-bytes{suffix}"
    elif got in NUMERIC:
        request.tensor = array_of(tensor, size, max_items)
        request.protocol = f"{prefix}-{got.lower()}{suffix}"
    else:
        raise InvalidTensor(
            f"datatype {got} is not supported; the image model takes BYTES (encoded "
            "images), UINT8 [N, H, W, 3], FP16 or FP32 [N, 3, H, W]"
        )
    return request


def encode_infer_response(
    embeddings: np.ndarray,
    *,
    model_name: str,
    request_id: str | None,
    outputs: Sequence[RequestedOutput],
    write_region: WriteRegion | None = None,
) -> tuple[bytes, dict[str, str], str]:
    """Body, extra headers and media type. Binary outputs follow the JSON header in order;
    an output in a shared-memory region is written there and answered without data."""
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for output in outputs:
        values = embeddings.astype(DTYPES[output.datatype], copy=False)
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(values.shape),
        }
        if output.region is not None:
            if write_region is None:
                raise InvalidTensor("shared memory is not served here")
            # No data and no parameters, as Triton answers: its C++ client (perf_analyzer)
            # reads `binary_data_size` from any output that has parameters.
            write_region(output.region, values.tobytes())
        elif output.binary:
            blobs.append(values.tobytes())
            entry["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            entry["data"] = values.reshape(-1)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": VERSION}
    if request_id is not None:
        doc["id"] = request_id
    doc["outputs"] = entries
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, {}, "application/json"
    headers = {HEADER_LENGTH: str(len(header))}
    return header + b"".join(blobs), headers, "application/octet-stream"


def encode_error(message: str) -> bytes:
    """Triton's error body: `{"error": "<message>"}`."""
    return orjson.dumps({"error": message})


def server_metadata() -> dict[str, Any]:
    return {"name": "clipserve", "version": __version__, "extensions": list(EXTENSIONS)}


def model_inputs(
    tower: TowerKind, datatype: str | None, size: tuple[int, int]
) -> list[dict[str, Any]]:
    """The inputs a model lists. The image model lists each it accepts (a request sends
    exactly one); a per-kind model (`datatype`) lists its one. BYTES are [-1, 1]: Triton's
    perf_analyzer drops the batch dimension and needs one left."""
    h, w = size
    if tower == "text":
        return [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}]
    inputs = [
        {"name": "image", "datatype": "BYTES", "shape": [-1, 1]},
        {"name": "pixels", "datatype": "UINT8", "shape": [-1, h, w, 3]},
        {"name": "pixel_values", "datatype": "FP32", "shape": [-1, 3, h, w]},
        {"name": "pixel_values_fp16", "datatype": "FP16", "shape": [-1, 3, h, w]},
    ]
    return [i for i in inputs if datatype is None or i["datatype"] == datatype]


def model_metadata(
    name: str, model: ServedModel, size: tuple[int, int], embed_dim: int, output: str
) -> dict[str, Any]:
    """What `GET /v2/models/{name}` answers (and gRPC's ModelMetadata)."""
    outputs = [
        {"name": n, "datatype": t, "shape": [-1, embed_dim]}
        for n, t in output_types(output).items()
    ]
    return {
        "name": name,
        "versions": [VERSION],
        "platform": "clipserve",
        "inputs": model_inputs(model.tower, model.datatype, size),
        "outputs": outputs,
    }


def repository_index(models: dict[str, bool]) -> list[dict[str, str]]:
    """`POST /v2/repository/index`, as Triton answers it: every model, ready or not."""
    return [
        {"name": name, "version": VERSION, "state": "READY" if ready else "UNAVAILABLE"}
        for name, ready in models.items()
    ]


def serialize_bytes(elements: Sequence[bytes]) -> bytes:
    """Triton's BYTES layout, for clients: each element prefixed by its 4-byte length."""
    return b"".join(LENGTH.pack(len(e)) + e for e in elements)


def build_infer_request(
    images: Sequence[bytes] | None = None,
    *,
    tensor: np.ndarray | None = None,
    texts: Sequence[str] | None = None,
    binary_output: bool = True,
    output: str = DEFAULT_OUTPUT,
) -> tuple[bytes, dict[str, str]]:
    """A binary inference request body and its headers, as tritonclient builds it: encoded
    images (BYTES), a UINT8/FP16/FP32 tensor, or texts (for the `-text` model). POST it to
    `/v2/models/<model>/infer`."""
    if tensor is not None:
        datatype = {np.dtype(v): k for k, v in NUMERIC.items()}[tensor.dtype]
        name = {"UINT8": "pixels", "FP16": "pixel_values_fp16"}.get(datatype, "pixel_values")
        shape, data = list(tensor.shape), np.ascontiguousarray(tensor).tobytes()
    elif texts is not None:
        name, datatype, shape = "text", "BYTES", [len(texts)]
        data = serialize_bytes([t.encode() for t in texts])
    elif images is not None:
        name, datatype, shape = "image", "BYTES", [len(images)]
        data = serialize_bytes(images)
    else:
        raise ValueError("give images, tensor or texts")
    sent = {
        "name": name,
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": len(data)},
    }
    wanted = {"name": output, "parameters": {"binary_data": binary_output}}
    header = orjson.dumps({"inputs": [sent], "outputs": [wanted]})
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return header + data, headers
