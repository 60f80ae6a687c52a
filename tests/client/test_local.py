"""Local mode on its own: /info's shape built in-process, bad items named as the server names
them, the arguments checked before anything starts, and the progress bar."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from clipserve.client import Client, ClientError, InvalidInput
from clipserve.client.progress import Progress
from tests.helpers import RunningServer, marked_png


def shape(doc: Any) -> Any:
    """A JSON document's keys, recursively, without its values."""
    return {k: shape(v) for k, v in doc.items()} if isinstance(doc, dict) else type(doc).__name__


def test_local_info_has_the_servers_shape(
    module_server: RunningServer, local_client: Client
) -> None:
    served = httpx.get(module_server.url + "/info").json()
    local = local_client.info()
    assert shape(local) == shape(served)
    for key in ("model", "embed_dim", "input_size", "mean", "std", "interpolation"):
        assert local[key] == served[key]
    assert local_client.mode_in_use == "local"


def test_local_bad_items_read_as_the_servers(local_client: Client, tmp_path: Path) -> None:
    text = tmp_path / "notes.jpg"
    text.write_text("not a photo")
    done = local_client.embed_images_checked([marked_png(1), text, b"", marked_png(2)])
    assert done.errors == {
        1: f"{text}: not a JPEG, PNG or WebP image",
        2: "<bytes #2>: empty image bytes",
    }
    assert np.isfinite(done.vectors[[0, 3]]).all() and np.isnan(done.vectors[[1, 2]]).all()
    with pytest.raises(InvalidInput) as raised:
        local_client.embed_texts(["a cat", "word " * 100])
    assert raised.value.index == 1 and "context" in raised.value.message
    assert local_client.embed_images([]).shape == local_client.embed_texts([]).shape == (0, 32)
    assert local_client.embed_images_checked([]).errors == {}


def test_arguments_are_checked_before_anything_starts(local_args: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="mode"):
        Client(mode="cloud")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="url"):
        Client(None, mode="auto")
    with pytest.raises(ValueError, match="http"):
        Client("127.0.0.1:8000")
    with pytest.raises(ValueError, match="batch_size"):
        Client(mode="local", batch_size=0, **local_args)
    with pytest.raises(ClientError, match="--checkpoint"):
        Client(mode="local", **{**local_args, "checkpoint": "/nonexistent.pt"})


def test_progress_is_drawn_on_a_terminal_only(
    local_args: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(mode="local", batch_size=4, progress=True, **local_args) as c:
        c.embed_images([marked_png(m) for m in range(10)])
        assert "embedding images [" in capsys.readouterr().err
        c.close()  # and again on leaving the block: closing twice is fine
    stream = io.StringIO()  # not a terminal
    quiet = Progress(10, "x", None, stream)
    quiet.advance(10)
    quiet.close()
    assert stream.getvalue() == ""
    bar = Progress(10, "embedding", True, stream)
    bar.advance(4)
    bar.advance(6)
    bar.close()
    assert "\rembedding [" in stream.getvalue()
    assert "10/10 100%" in stream.getvalue() and stream.getvalue().endswith("\n")
