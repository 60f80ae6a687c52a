"""Payload kinds: each wire format the server accepts, as a named builder of HTTP requests.

A kind turns a few source images (or texts) into a ready-to-send `Request`; the load generator
rotates over a handful of them so no two consecutive requests are byte-identical. A new wire
format is one `@register(...)` function here and nothing else.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import orjson

from clipserve.inference.preprocess import ImageDecoder, PreprocessSpec
from clipserve.loadgen.images import SourceImage, encode
from clipserve.protocol.kserve import DEFAULT_OUTPUT, TEXT_SUFFIX, build_infer_request
from clipserve.protocol.openai import build_embeddings_request

# A benchmark sends a few payloads over and over: without this, an embedding cache would answer
# them (what the server's `cache` stage measures), not the model.
NO_CACHE = {"Cache-Control": "no-cache"}
ACCEPT = {
    "json": "application/json",
    "msgpack": "application/msgpack",
    "raw": "application/octet-stream",
}
TEXTS = (
    "a photo of a cat",
    "a diagram of a transformer",
    "two dogs playing in the snow",
    "a bowl of ramen",
    "the night sky over a desert",
    "a red bicycle against a wall",
    "an aerial view of a harbour",
    "a handwritten note",
)


@dataclass(frozen=True)
class Request:
    """One request ready to send; `items` is how many images (or texts) it carries."""

    path: str
    body: bytes
    headers: Mapping[str, str]
    items: int
    method: str = "POST"


@dataclass(frozen=True)
class ModelInput:
    """What tensor payloads need to know about the model: from the server's `GET /info`."""

    spec: PreprocessSpec
    name: str = "model"  # KServe's image model
    text_name: str = "model" + TEXT_SUFFIX  # KServe's text model
    openai_name: str = "model"
    output: str = DEFAULT_OUTPUT  # KServe's FP32 output

    @classmethod
    def from_info(cls, info: Mapping[str, object]) -> ModelInput:
        size = info.get("input_size", [224, 224])
        mean = info.get("mean", (0.48145466, 0.4578275, 0.40821073))
        std = info.get("std", (0.26862954, 0.26130258, 0.27577711))
        assert isinstance(size, list | tuple) and isinstance(mean, list | tuple)
        assert isinstance(std, list | tuple)
        h, w = (int(v) for v in size)
        spec = PreprocessSpec(
            (h, w),
            (float(mean[0]), float(mean[1]), float(mean[2])),
            (float(std[0]), float(std[1]), float(std[2])),
        )
        name = str(info.get("model_name", "model"))
        names = info.get("names")  # the first of each list of --served-model-name and kin
        if not isinstance(names, dict):
            return cls(spec, name, name + TEXT_SUFFIX, name)
        image, text, openai = (
            str(names[key][0])
            for key in ("served_model_names", "served_text_model_names", "openai_models")
        )
        return cls(spec, image, text, openai, str(names.get("kserve_output", DEFAULT_OUTPUT)))


@dataclass(frozen=True)
class Context:
    """Everything a builder may use for one request."""

    images: Sequence[SourceImage]  # exactly the images this request carries
    model: ModelInput
    texts: Sequence[str] = TEXTS
    tensor_dtype: str = "uint8"  # uint8 NHWC, or float16/float32 normalised NCHW
    accept: str = "application/json"
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    index: int = 0  # which of the rotating variants this is
    # Each source's crop, made once for all the variants that carry it (id of the source).
    crops: dict[int, np.ndarray] = field(default_factory=dict)

    def headers(self, content_type: str, **more: str) -> dict[str, str]:
        return {"Content-Type": content_type, "Accept": self.accept, **more, **self.extra_headers}

    def encoded(self, fmt: str = "JPEG") -> list[bytes]:
        """The images as files: their own bytes if they came from one, else encoded as `fmt`."""
        return [
            s.data if s.data is not None and s.format in (fmt, None) else encode(s.image, fmt)
            for s in self.images
        ]

    def encoded_any(self) -> list[bytes]:
        """The images as files the server accepts: originals as they are, synthetic as JPEG."""
        return [s.data if s.data is not None else encode(s.image, "JPEG") for s in self.images]

    def tensor(self) -> np.ndarray:
        """The crops the server would make, uint8 NHWC, or normalised NCHW floats."""
        spec = self.model.spec
        decoder = ImageDecoder(spec, 10**9)
        for s in self.images:
            if id(s) not in self.crops:  # lossless: the server's decoder makes its own crop
                self.crops[id(s)] = decoder(encode(s.image, "PNG", compress_level=1))
        pixels = np.stack([self.crops[id(s)] for s in self.images])
        if self.tensor_dtype == "uint8":
            return pixels
        from clipserve.backends.base import normalise_numpy

        return normalise_numpy(pixels, spec).astype(self.tensor_dtype)


Builder = Callable[[Context], Request]


@dataclass(frozen=True)
class PayloadKind:
    name: str
    help: str
    build: Builder
    single: bool = False  # one image per request, whatever --images-per-request says
    text: bool = False  # carries texts, not images


KINDS: dict[str, PayloadKind] = {}


def register(
    name: str, help: str, *, single: bool = False, text: bool = False
) -> Callable[[Builder], Builder]:
    def add(build: Builder) -> Builder:
        KINDS[name] = PayloadKind(name, help, build, single, text)
        return build

    return add


def kind(name: str) -> PayloadKind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown payload kind {name!r}; one of {', '.join(KINDS)}") from None


def _single(fmt: str, media: str) -> Builder:
    def build(ctx: Context) -> Request:
        return Request("/embed", ctx.encoded(fmt)[0], ctx.headers(media), 1)

    return build


@register("ping", "GET /healthz, no body: the client's own ceiling against any server", single=True)
def _ping(ctx: Context) -> Request:
    return Request("/healthz", b"", {"Accept": ctx.accept}, 1, method="GET")


register("jpeg", "one JPEG per request (Content-Type: image/jpeg)", single=True)(
    _single("JPEG", "image/jpeg")
)
register("png", "one PNG per request", single=True)(_single("PNG", "image/png"))
register("webp", "one WebP per request", single=True)(_single("WEBP", "image/webp"))


@register("multipart", "multipart/form-data, one file part per image")
def _multipart(ctx: Context) -> Request:
    boundary = "clipservebench"
    parts = io.BytesIO()
    for i, data in enumerate(ctx.encoded_any()):
        parts.write(
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{i}.img"'
            f"\r\nContent-Type: application/octet-stream\r\n\r\n".encode()
        )
        parts.write(data + b"\r\n")
    parts.write(f"--{boundary}--\r\n".encode())
    headers = ctx.headers(f"multipart/form-data; boundary={boundary}")
    return Request("/embed", parts.getvalue(), headers, len(ctx.images))


@register("msgpack-images", 'msgpack {"images": [<encoded image>, ...]}')
def _msgpack_images(ctx: Context) -> Request:
    body = msgpack.packb({"images": ctx.encoded_any()})
    return Request("/embed", body, ctx.headers("application/msgpack"), len(ctx.images))


@register("json-base64", 'JSON {"images": ["<base64>", ...]}')
def _json_base64(ctx: Context) -> Request:
    images = [base64.b64encode(d).decode() for d in ctx.encoded_any()]
    body = orjson.dumps({"images": images})
    return Request("/embed", body, ctx.headers("application/json"), len(ctx.images))


@register("msgpack-tensor", 'msgpack {"tensor": {dtype, shape, data}} (see --tensor-dtype)')
def _msgpack_tensor(ctx: Context) -> Request:
    a = ctx.tensor()
    tensor = {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tobytes()}
    body = msgpack.packb({"tensor": tensor})
    return Request("/embed", body, ctx.headers("application/msgpack"), len(a))


@register("raw-tensor", "raw tensor bytes with X-Tensor-Dtype/X-Tensor-Shape (--tensor-dtype)")
def _raw_tensor(ctx: Context) -> Request:
    a = ctx.tensor()
    headers = ctx.headers(
        "application/octet-stream",
        **{"X-Tensor-Dtype": str(a.dtype), "X-Tensor-Shape": ",".join(map(str, a.shape))},
    )
    return Request("/embed", a.tobytes(), headers, len(a))


def _texts(ctx: Context) -> list[str]:
    n, offset = len(ctx.images), ctx.index * len(ctx.images)
    return [ctx.texts[(offset + i) % len(ctx.texts)] for i in range(n)]


@register("text-json", 'POST /embed/text, JSON {"texts": [...]}', text=True)
def _text_json(ctx: Context) -> Request:
    texts = _texts(ctx)
    body = orjson.dumps({"texts": texts})
    return Request("/embed/text", body, ctx.headers("application/json"), len(texts))


@register("text-msgpack", 'POST /embed/text, msgpack {"texts": [...]}', text=True)
def _text_msgpack(ctx: Context) -> Request:
    texts = _texts(ctx)
    body = msgpack.packb({"texts": texts})
    return Request("/embed/text", body, ctx.headers("application/msgpack"), len(texts))


@register("openai-images", "POST /v1/embeddings, images as data: URIs (OpenAI's API)")
def _openai_images(ctx: Context) -> Request:
    body = build_embeddings_request(ctx.encoded_any(), ctx.model.openai_name)
    return Request("/v1/embeddings", body, ctx.headers("application/json"), len(ctx.images))


@register("openai-texts", "POST /v1/embeddings, texts (OpenAI's API)", text=True)
def _openai_texts(ctx: Context) -> Request:
    body = build_embeddings_request(_texts(ctx), ctx.model.openai_name)
    return Request("/v1/embeddings", body, ctx.headers("application/json"), len(ctx.images))


def _kserve(ctx: Context, built: tuple[bytes, dict[str, str]], text: bool = False) -> Request:
    """A request to the KServe route of the image (or text) model from
    `build_infer_request`'s body and headers."""
    body, headers = built
    path = f"/v2/models/{ctx.model.text_name if text else ctx.model.name}/infer"
    return Request(path, body, {**headers, **ctx.extra_headers}, len(ctx.images))


@register("kserve-images", "Open Inference Protocol (KServe v2), encoded images as BYTES")
def _kserve_images(ctx: Context) -> Request:
    return _kserve(ctx, build_infer_request(ctx.encoded_any(), output=ctx.model.output))


@register("kserve-tensor", "Open Inference Protocol (KServe v2), a tensor (--tensor-dtype)")
def _kserve_tensor(ctx: Context) -> Request:
    return _kserve(ctx, build_infer_request(tensor=ctx.tensor(), output=ctx.model.output))


@register("kserve-texts", "Open Inference Protocol (KServe v2), texts (the -text model)", text=True)
def _kserve_texts(ctx: Context) -> Request:
    built = build_infer_request(texts=_texts(ctx), output=ctx.model.output)
    return _kserve(ctx, built, text=True)


def build_requests(
    name: str,
    sources: Sequence[SourceImage],
    model: ModelInput,
    *,
    images_per_request: int = 1,
    variants: int = 8,
    tensor_dtype: str = "uint8",
    accept: str = "application/json",
    extra_headers: Mapping[str, str] | None = None,
) -> list[Request]:
    """Up to `variants` distinct requests of kind `name`, rotating over `sources`, each with
    `extra_headers`."""
    k = kind(name)
    n = 1 if k.single else images_per_request
    if n < 1:
        raise ValueError("--images-per-request must be at least 1")
    if k.single and images_per_request != 1:
        raise ValueError(f"payload {name} carries one image per request (--images-per-request 1)")
    if tensor_dtype not in ("uint8", "float16", "float32"):
        raise ValueError(f"--tensor-dtype {tensor_dtype}: one of uint8, float16, float32")
    out = []
    crops: dict[int, np.ndarray] = {}
    for v in range(max(1, min(variants, len(sources)))):
        images = [sources[(v * n + i) % len(sources)] for i in range(n)]
        ctx = Context(
            images,
            model,
            tensor_dtype=tensor_dtype,
            accept=accept,
            index=v,
            crops=crops,
            extra_headers=extra_headers or {},
        )
        out.append(k.build(ctx))
    return out
