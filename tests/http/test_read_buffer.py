"""Reads land in a buffer of the protocol's thread (http/buffered.py), reused for every read: two
servers on two threads of one process, each with many clients sending pipelined bodies of many
sizes at once, must each see every byte of every body as it was sent, read by get_buffer and
buffer_updated (uvloop reads so only into a protocol that is no asyncio.Protocol)."""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from clipserve.config import HttpConfig
from clipserve.http.buffered import READ_BYTES, BufferedReads
from clipserve.http.server import build_uvicorn_config, protocol_class
from clipserve.loadgen.procs import free_port
from tests.helpers import uvicorn_thread

CLIENTS = 6  # per server
REQUESTS = 4  # per client, pipelined in one send


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers the sha256 of the body it read."""
    if scope["type"] != "http":
        return
    digest, more = hashlib.sha256(), True
    while more:
        message = await receive()
        digest.update(message.get("body", b""))
        more = message.get("more_body", False)
    answer = digest.hexdigest().encode()
    headers = [(b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


class Counted(BufferedReads):
    """The served protocol, counting the reads that came through its buffer."""

    reads: ClassVar[int] = 0

    def buffer_updated(self, nbytes: int) -> None:
        type(self).reads += 1
        super().buffer_updated(nbytes)


@pytest.fixture(scope="module")
def servers() -> Iterator[list[tuple[int, type[Counted]]]]:
    served = []
    for _ in range(2):
        counted = type("Counted", (Counted, protocol_class(HttpConfig())), {"reads": 0})
        port = free_port()
        served.append(
            (
                counted,
                build_uvicorn_config(echo, HttpConfig(), host="127.0.0.1", port=port, http=counted),
            )
        )
    with uvicorn_thread(uvicorn.Server(served[0][1])), uvicorn_thread(uvicorn.Server(served[1][1])):
        yield [(config.port, counted) for counted, config in served]


def _answers(sock: socket.socket, count: int) -> list[bytes]:
    """`count` answers' bodies, read by their content-length."""
    data, answers = b"", list[bytes]()
    while len(answers) < count:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            if len(rest) >= length:
                answers.append(rest[:length])
                data = rest[length:]
                continue
        chunk = sock.recv(1 << 16)
        assert chunk, "the server closed the connection"
        data += chunk
    return answers


def _client(port: int, seed: int) -> list[tuple[str, str]]:
    """(sent, answered) digests of REQUESTS bodies from 1 byte to past two read buffers."""
    rng = random.Random(seed)
    bodies = [rng.randbytes(rng.randint(1, 2 * READ_BYTES + 4096)) for _ in range(REQUESTS)]
    wire = b"".join(
        b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(b) + b for b in bodies
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(wire)
        answers = _answers(sock, REQUESTS)
    return [
        (hashlib.sha256(b).hexdigest(), a.decode()) for b, a in zip(bodies, answers, strict=True)
    ]


def test_reads_use_a_buffer_of_their_own_thread(servers: list[tuple[int, type[Counted]]]) -> None:
    assert not issubclass(protocol_class(HttpConfig()), asyncio.Protocol)
    jobs = [(port, seed) for seed in range(CLIENTS) for port, _ in servers]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _client(*job), jobs))
    pairs = [pair for result in results for pair in result]
    assert len(pairs) == len(jobs) * REQUESTS
    assert all(sent == answered for sent, answered in pairs)
    assert all(counted.reads >= CLIENTS for _, counted in servers)
