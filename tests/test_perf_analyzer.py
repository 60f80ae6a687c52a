"""Triton's own perf_analyzer against a real `clipserve` (fake backend, tiny model) over gRPC and
HTTP: it reads the model's metadata and config, then drives inference. Slow (a few seconds a
run) and needs the binary: `make perf-analyzer-env` (scripts/perf_analyzer_env.sh) puts it in
.perf-analyzer/, or PERF_ANALYZER names one."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from clipserve.loadgen.procs import clipserve_process, free_port

ROOT = Path(__file__).resolve().parent.parent
BINARY = Path(os.environ.get("PERF_ANALYZER", ROOT / ".perf-analyzer" / "perf_analyzer"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not BINARY.exists(), reason=f"no perf_analyzer at {BINARY}: run make perf-analyzer-env"
    ),
]
MODEL = "tiny-clip"


def _bytes_data(name: str, element: bytes) -> dict[str, object]:
    """perf_analyzer's --input-data for one BYTES element: the 4-byte length prefix inside
    the base64, as Triton lays BYTES out."""
    prefixed = struct.pack("<I", len(element)) + element
    return {"data": [{name: {"b64": base64.b64encode(prefixed).decode()}}]}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("perf-analyzer")
    out = io.BytesIO()
    Image.new("RGB", (640, 480), (120, 30, 200)).save(out, "JPEG", quality=90)
    (directory / "jpeg.json").write_text(json.dumps(_bytes_data("image", out.getvalue())))
    (directory / "text.json").write_text(json.dumps(_bytes_data("text", b"a photo of a cat")))
    return directory


@pytest.fixture(scope="module")
def server(tiny_config: Path) -> Iterator[tuple[str, int]]:
    grpc_port = free_port()
    flags = ["--backend", "fake", "--model", str(tiny_config), "--pretrained", "none"]
    flags += ["--gpus", "cpu", "--cache-mb", "0", "--grpc-port", str(grpc_port)]
    flags += ["--shm-max-regions", "8"]  # perf_analyzer's --shared-memory system
    with clipserve_process(flags, startup_s=120) as (_, url):
        yield url.removeprefix("http://"), grpc_port


CASES = {
    "image-jpeg": (MODEL, ["--input-data", "{data}/jpeg.json"]),
    "bytes-jpeg": (MODEL + "-bytes", ["--input-data", "{data}/jpeg.json"]),
    "uint8-random": (MODEL + "-uint8", []),
    "fp32-zero": (MODEL + "-fp32", ["--input-data", "zero"]),
    "text": (MODEL + "-text", ["--input-data", "{data}/text.json"]),
    "uint8-shm": (MODEL + "-uint8", ["--shared-memory", "system"]),
}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("case", list(CASES))
def test_perf_analyzer_runs(
    server: tuple[str, int], data: Path, tmp_path: Path, protocol: str, case: str
) -> None:
    http_address, grpc_port = server
    url = f"127.0.0.1:{grpc_port}" if protocol == "grpc" else http_address
    model, extra = CASES[case]
    report = tmp_path / "report.csv"
    cmd = [str(BINARY), "-m", model, "-u", url, "-i", protocol, "-f", str(report)]
    cmd += ["--concurrency-range", "2", "--measurement-mode", "count_windows"]
    cmd += ["--measurement-request-count", "100", "--stability-percentage", "50"]
    cmd += [arg.format(data=data) for arg in extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = list(csv.DictReader(io.StringIO(report.read_text())))
    assert rows and float(rows[0]["Inferences/Second"]) > 0, rows
    print(
        f"{case} over {protocol}: {float(rows[0]['Inferences/Second']):.0f} infer/s",
        file=sys.stderr,
    )
    # perf_analyzer 2.45 may leave its output region (/dev/shm/embedding) after a gRPC run:
    # its file, not the server's; removed so the next run starts clean.
    Path("/dev/shm/embedding").unlink(missing_ok=True)
