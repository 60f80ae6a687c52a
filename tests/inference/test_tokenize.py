"""The text tower's tokenizer against words no language has: a long run of letters costs its
pieces' BPE, not a quadratic one, and never enters the BPE cache; real texts tokenise exactly
as open_clip does."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from clipserve.inference.model import CACHED_WORD, LONGEST_WORD, LoadedModel, load_model
from tests.helpers import make_config


@pytest.fixture(scope="module")
def model(tiny_config: Path, tiny_checkpoint: Path) -> LoadedModel:
    return load_model(make_config(tiny_config, tiny_checkpoint, backend="fake").model)


def _letters(rng: random.Random, n: int, first: int = 97, span: int = 26) -> str:
    return "".join(chr(first + rng.randrange(span)) for _ in range(n))


def test_real_texts_tokenise_as_open_clip_does(model: LoadedModel, tiny_config: Path) -> None:
    import open_clip

    texts = ["a photo of a cat", "Überraschung! 東京タワーの夜景、とても綺麗でした。", ""]
    texts.append("pneumonoultramicroscopicsilicovolcanoconiosis " * 3)  # 45 letters: kept whole
    compound = "Donaudampfschifffahrtselektrizitätenhauptbetriebswerkbauunterbeamtengesellschaft"
    texts.append(f"die {compound} und ihre Mitarbeiter")  # 79 letters, ~20 tokens: kept whole
    texts.append("class " + "VeryLongCamelCaseIdentifierName" * 4)  # 124 letters
    want = open_clip.get_tokenizer(tiny_config.stem)(texts).numpy()
    assert np.array_equal(model.tokenize(texts), want)


def test_a_long_run_of_letters_reaches_the_bpe_in_pieces(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(0)
    words = [_letters(rng, 1000), _letters(rng, 300, 0x4E00, 20000)]  # Latin, and CJK
    seen: list[int] = []
    bpe = model.tokenizer.bpe

    def recorded(token: str) -> str:
        seen.append(len(token))
        return str(bpe(token))

    monkeypatch.setattr(model.tokenizer, "bpe", recorded)
    ids = model.tokenize([f"a photo of {w} at dusk" for w in words], truncate=True)
    assert ids.shape == (2, model.context_length)
    # Byte-encoded: a CJK character is 3 characters of the BPE's alphabet.
    assert seen and max(seen) <= 3 * LONGEST_WORD
    spaced = [
        " ".join(w[i : i + LONGEST_WORD] for i in range(0, len(w), LONGEST_WORD)) for w in words
    ]
    again = model.tokenize([f"a photo of {w} at dusk" for w in spaced], truncate=True)
    assert np.array_equal(ids, again)  # the cut is a blank between pieces, nothing else


def test_the_bpe_cache_keeps_short_words_only(model: LoadedModel) -> None:
    rng = random.Random(1)
    model.tokenize([_letters(rng, 60) for _ in range(8)] + ["zebra crossing"], truncate=True)
    cache = model.tokenizer.cache
    assert all(len(word) <= CACHED_WORD for word in cache)
    assert "zebra" in cache  # a short word is cached
