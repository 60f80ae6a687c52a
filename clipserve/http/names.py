"""The names clients call the model by, on every front door (--served-model-name and kin).

A client migrating from Triton, NIM or Infinity keeps its own model and output names: the
flags set them, and every door lists and accepts the same ones. The first name of each list
is the canonical one: answers that name a model without being asked use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clipserve.batching.tower import TowerKind
from clipserve.config import ModelConfig
from clipserve.errors import ModelNotFound
from clipserve.protocol.kserve import TEXT_SUFFIX, VERSION

# A model per input kind beside each image model: one required input each, which Triton's
# perf_analyzer needs for random data and shared memory (it sends every input a model lists,
# and refuses shared memory with optional inputs).
KIND_SUFFIXES = {"-bytes": "BYTES", "-uint8": "UINT8", "-fp32": "FP32", "-fp16": "FP16"}


@dataclass(frozen=True)
class KServeModel:
    """A KServe model: its tower, and the one input datatype it takes (None: the image
    model's four optional inputs, or the text model's one)."""

    tower: TowerKind
    datatype: str | None = None


@dataclass(frozen=True)
class ServedNames:
    image: tuple[str, ...]  # KServe's image model
    text: tuple[str, ...]  # KServe's text model
    openai: tuple[str, ...]  # OpenAI's model: both towers, as one CLIP model
    output: str  # KServe's FP32 output; output + "_fp16" is the FP16 one

    @classmethod
    def of(cls, config: ModelConfig, name: str, identity: str) -> ServedNames:
        """Defaults: the model's name for KServe (name + "-text" for the text tower); on
        OpenAI the identity (name/weights) first, then the bare name."""
        image = config.served_model_name or (name,)
        text = config.served_text_model_name or tuple(n + TEXT_SUFFIX for n in image)
        openai = config.served_model_name or tuple(dict.fromkeys((identity, name)))
        return cls(image, text, openai, config.output_name)

    def kserve(self) -> dict[str, TowerKind]:
        """Every KServe model name, and the tower it runs on."""
        return {name: model.tower for name, model in self.kserve_models().items()}

    def kserve_models(self) -> dict[str, KServeModel]:
        """Every KServe model: each image name, each text name, then each image name's
        per-kind models."""
        models = {n: KServeModel("image") for n in self.image}
        models.update((n, KServeModel("text")) for n in self.text)
        for name in self.image:
            models.update(
                (name + suffix, KServeModel("image", datatype))
                for suffix, datatype in KIND_SUFFIXES.items()
            )
        return models

    def card(self) -> dict[str, Sequence[str] | str]:
        """What `/info` reports."""
        return {
            "served_model_names": list(self.image),
            "served_text_model_names": list(self.text),
            "openai_models": list(self.openai),
            "kserve_output": self.output,
        }


def resolve_model(names: ServedNames, name: str, version: str) -> tuple[str, KServeModel]:
    """The model a request names (HTTP path or gRPC message); ModelNotFound for any other
    model or version. "" is the latest version, as Triton's clients send it."""
    models = names.kserve_models()
    if name not in models:
        served = ", ".join(repr(m) for m in models)
        raise ModelNotFound(
            f"Request for unknown model: '{name}' is not found; this server serves {served}"
        )
    if version not in ("", VERSION):
        raise ModelNotFound(
            f"Request for unknown model: '{name}' version {version} is not found; its only "
            f"version is {VERSION}"
        )
    return name, models[name]
