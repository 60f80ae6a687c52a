"""Loading an open_clip model and its preprocessing parameters (tag | checkpoint | none)."""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clipserve.config import ModelConfig
from clipserve.errors import StartupError, TextTooLong
from clipserve.inference.preprocess import PreprocessSpec

log = logging.getLogger(__name__)
TOKENIZER_CACHE_ENTRIES = 50_000
RANDOM_WEIGHTS_SEED = 0  # --pretrained none: the same weights in every process (load_model)
# open_clip's BPE (pure Python) is quadratic in a word's length: a 1000-letter "word" took
# ~40 ms, and a request of 64 such texts held the text tower for seconds. Longer runs of
# letters are cut into pieces this long: real words, German compounds and CamelCase names are
# shorter (a 79-letter compound is ~20 tokens, inside the context: a cut at 64 changed them),
# and so are CJK runs between punctuation.
LONGEST_WORD = 128
# Words the BPE cache keeps: at most this long, byte-encoded (a CJK character is 3), so its
# memory is bounded by its entries whatever words clients invent (1000-character ones took
# ~17 KB an entry).
CACHED_WORD = 48
_LONG_RUN = re.compile(rf"[^\W\d_]{{{LONGEST_WORD + 1},}}")  # letters: \w less digits and _


def cut_long_words(text: str) -> str:
    """`text` with every run of letters over LONGEST_WORD split by blanks into pieces."""
    if len(text) <= LONGEST_WORD:
        return text
    return _LONG_RUN.sub(_pieces, text)


def _pieces(run: re.Match[str]) -> str:
    word = run[0]
    return " ".join(word[i : i + LONGEST_WORD] for i in range(0, len(word), LONGEST_WORD))


class _ShortWords(dict[str, str]):
    """open_clip's BPE cache, keeping short words only (its lookups stay dict's own)."""

    def __setitem__(self, word: str, tokens: str) -> None:
        if len(word) <= CACHED_WORD:
            super().__setitem__(word, tokens)


@dataclass
class LoadedModel:
    """A CPU FP32 open_clip model in eval mode, and what the server needs to know about it."""

    module: Any  # open_clip CLIP / CustomTextCLIP (untyped upstream)
    name: str
    weights_id: str  # pretrained tag, "sha256:<12 hex>" of a checkpoint, or "random"
    preprocess: PreprocessSpec
    embed_dim: int
    tokenizer: Any  # open_clip tokenizer: list[str] → LongTensor (N, context_length)
    context_length: int
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def tokenize(
        self,
        texts: list[str],
        *,
        truncate: bool = True,
        positions: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Token ids (N, context_length), as the model reads them. A text over the context
        is cut to fit (its last token the end token, as open_clip cuts it) where `truncate`,
        else refused: TextTooLong naming its place (`positions[i]`, default i). CPU work: run
        it in the decode pool."""
        # One token more than the context: a text that fits leaves that column padding, so
        # one call both tokenises and finds the texts that do not fit.
        wide = self._tokenize(texts, self.context_length + 1)
        pad = self._pad
        over = np.flatnonzero(wide[:, -1] != pad)
        if len(over) and not truncate:
            where = int(over[0]) if positions is None else positions[int(over[0])]
            raise TextTooLong(
                f"item {where}: over the model's context of {self.context_length} tokens "
                "(start and end tokens included); shorten it, or ask for truncation "
                '(--truncate-text; OpenAI: "truncate": "END")'
            )
        ids = wide[:, :-1].copy()
        ids[over, -1] = wide[over, -1]  # the end token, where the cut put it
        return ids

    def tokens_seen(self, ids: np.ndarray) -> int:
        """Tokens the model reads in `tokenize`'s ids: up to each end token (the pad id is a
        real token too, e.g. "!" in CLIP's BPE, so counting non-pad ids would miss some)."""
        real = ids != self._pad
        last = ids.shape[1] - np.argmax(real[:, ::-1], axis=1)  # one past the last real token
        return int(np.where(real.any(axis=1), last, 0).sum())

    @functools.cached_property
    def _pad(self) -> int:
        """The tokenizer's padding id: what follows the end token of an empty text."""
        return int(self._tokenize([""], self.context_length)[0, -1])

    def _tokenize(self, texts: list[str], context_length: int) -> np.ndarray:
        # open_clip's BPE cache keeps every distinct word it has seen (150-220 bytes each, so
        # ~10 MiB at the cap: bench/soak.py's tracemalloc run): a stream of random words would
        # grow it without bound, so it starts over past a fixed size, and keeps short words.
        # The lock costs no parallelism (the tokenizer is pure Python, holding the GIL) and
        # keeps a clear from racing another thread's cache lookup.
        with self._tokenizer_lock:
            cache = getattr(self.tokenizer, "cache", None)
            if isinstance(cache, dict):  # the BPE tokenizer (HF's are not Python, nor cached)
                if type(cache) is dict:
                    self.tokenizer.cache = cache = _ShortWords(cache)
                if len(cache) > TOKENIZER_CACHE_ENTRIES:
                    specials = {k: v for k, v in cache.items() if k == v}  # <start_of_text>
                    cache.clear()
                    cache.update(specials)
                texts = [cut_long_words(text) for text in texts]
            tokens = self.tokenizer(texts, context_length=context_length)
        ids: np.ndarray = tokens.numpy().astype(np.int64, copy=False)
        return ids

    @property
    def identity(self) -> str:
        return f"{self.name}/{self.weights_id}"

    @functools.cached_property
    def visual_digest(self) -> str:
        """A hash of the image tower's weights themselves (so random weights never reuse an
        export); computed once per loaded model, however many devices ask."""
        h = hashlib.sha256()
        for name, tensor in sorted(self.module.visual.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def file_digest(path: Path, length: int = 12) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:length]


def resolve_name(model: str) -> str:
    """An open_clip name, or a JSON config file registered with open_clip under its stem."""
    import open_clip

    path = Path(model)
    if model.endswith(".json"):
        if not path.is_file():
            raise StartupError(f"--model: config file {model} does not exist")
        open_clip.add_model_config(path)
        return path.stem
    if model not in open_clip.list_models():
        raise StartupError(
            f"--model: unknown open_clip model {model!r}; pass a name from "
            "open_clip.list_models() or a path to a JSON model config"
        )
    return model


def load_model(config: ModelConfig) -> LoadedModel:
    """Build the model on the CPU in FP32; executors copy it to their devices and precisions."""
    import open_clip
    import torch

    from clipserve.inference.hub import offline_if_unreachable, route_hub_logs

    name = resolve_name(config.model)
    pretrained = None if config.pretrained.lower() in ("none", "") else config.pretrained
    if config.checkpoint:
        pretrained = None
    route_hub_logs()
    offline = None if pretrained is None else offline_if_unreachable()
    try:
        # Random weights from one seed: every process (front ends' engine, a client's local
        # mode, an export) builds the same model, so their vectors and exports agree.
        with torch.random.fork_rng(devices=[]):  # built on the CPU: its generator alone
            torch.default_generator.manual_seed(RANDOM_WEIGHTS_SEED)
            module = open_clip.create_model(name, pretrained=pretrained)
    except Exception as e:  # unknown tag, hub unreachable, partial download, ...
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if pretrained is None:  # no weights asked for: the model itself could not be built
            raise StartupError(
                f"--model {config.model}: could not build {name} ({reason})"
            ) from None
        if offline is not None and "download" in reason.lower():  # not a bad tag's error
            reason = f"the Hub cannot be reached ({offline}) and the local cache has no copy"
        elif offline is not None:
            reason = f"{reason}; the Hub cannot be reached ({offline})"
        raise StartupError(
            f"--pretrained {config.pretrained}: could not load weights for {name} ({reason}); "
            "pass --checkpoint PATH with local weights, or --pretrained none for random weights"
        ) from None

    if config.checkpoint:
        path = Path(config.checkpoint)
        if not path.is_file():
            raise StartupError(f"--checkpoint: file {path} does not exist")
        try:
            open_clip.load_checkpoint(module, str(path), strict=True, weights_only=True)
        except (RuntimeError, KeyError, ValueError) as e:
            first = str(e).strip().splitlines()[0][:300]
            raise StartupError(
                f"--checkpoint {path} does not fit --model {config.model} ({first}); "
                "pass the --model the checkpoint was trained with"
            ) from None
        except Exception as e:  # unpicklable, corrupt file, ...
            raise StartupError(
                f"--checkpoint {path} could not be read ({type(e).__name__}: {e}); "
                "expected a state dict saved with torch.save (.pt) or a .safetensors file"
            ) from None
        weights_id = "sha256:" + file_digest(path)
    elif pretrained is None:
        log.warning(
            "!!! --pretrained none: %s has RANDOM weights; its embeddings mean nothing. "
            "Use this for testing only. !!!",
            name,
        )
        weights_id = "random"
    else:
        weights_id = pretrained

    module.eval()
    preprocess = PreprocessSpec.from_open_clip(open_clip.get_model_preprocess_cfg(module))
    with torch.inference_mode():
        probe = torch.zeros(1, 3, *preprocess.size)
        embed_dim = int(module.encode_image(probe).shape[-1])
    tokenizer = open_clip.get_tokenizer(name)
    context_length = int(getattr(tokenizer, "context_length", None) or module.context_length)
    return LoadedModel(module, name, weights_id, preprocess, embed_dim, tokenizer, context_length)
