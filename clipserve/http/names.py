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
from clipserve.protocol.kserve import TEXT_SUFFIX


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
        towers: dict[str, TowerKind] = {n: "image" for n in self.image}
        towers.update((n, "text") for n in self.text)
        return towers

    def card(self) -> dict[str, Sequence[str] | str]:
        """What `/info` reports."""
        return {
            "served_model_names": list(self.image),
            "served_text_model_names": list(self.text),
            "openai_models": list(self.openai),
            "kserve_output": self.output,
        }
