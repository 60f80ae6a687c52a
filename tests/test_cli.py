"""The `clipserve` command: configuration, one-line startup failures, SIGTERM draining."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from clipserve.cli import build_parser
from clipserve.config import ServerConfig, iter_options, load_config
from clipserve.errors import ConfigError
from tests.helpers import PNG, cli_server, png_bytes, random_pixels, run_clipserve, write_checkpoint


def test_flag_beats_env_beats_default() -> None:
    env = {"CLIPSERVE_MAX_BATCH_SIZE": "16", "CLIPSERVE_PORT": "9000", "CLIPSERVE_GPUS": "cpu"}
    config = load_config({"max_batch_size": "8"}, env)
    assert config.batching.max_batch_size == 8  # flag
    assert config.http.port == 9000  # env
    assert config.backend.gpus == "cpu"
    assert config.batching.max_queue_delay_ms == 10.0  # default
    assert load_config({}, {}) == ServerConfig()


def test_every_option_has_a_flag_and_an_env_name() -> None:
    flags = {a.dest for a in build_parser()._actions}
    for option in iter_options():
        assert option.name in flags
        assert option.env == "CLIPSERVE_" + option.name.upper()


def test_repeatable_option_from_flag_and_env() -> None:
    assert load_config({"backend_option": ["a=1", "b=2"]}, {}).backend.options() == {
        "a": "1",
        "b": "2",
    }
    assert load_config({}, {"CLIPSERVE_BACKEND_OPTION": "a=1,b=2"}).backend.backend_option == (
        "a=1",
        "b=2",
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"max_batch_size": "0"}, "--max-batch-size"),
        ({"max_batch_size": "many"}, "--max-batch-size"),
        ({"max_batch_size": "64", "max_queue_size": "32"}, "--max-queue-size"),
        ({"request_timeout_s": "-1"}, "--request-timeout-s"),
        ({"gpus": "first"}, "--gpus"),
        ({"precision": "int4"}, "--precision"),
        ({"backend_option": ["novalue"]}, "--backend-option"),
        ({"max_items_per_request": "1000"}, "--max-items-per-request"),
        ({"max_connections": "0"}, "--max-connections"),
        ({"grpc_max_connection_idle_s": "-1"}, "--grpc-max-connection-idle-s"),
        ({"grpc_max_connection_age_s": "-1"}, "--grpc-max-connection-age-s"),
        ({"engine_start_timeout_s": "0"}, "--engine-start-timeout-s"),
        ({"max_header_bytes": "100"}, "--max-header-bytes"),
        ({"header_timeout_s": "0"}, "--header-timeout-s"),
        ({"keep_alive_timeout_s": "0"}, "--keep-alive-timeout-s"),
        ({"linger_timeout_s": "-1"}, "--linger-timeout-s"),
        ({"served_model_name": ["my model"]}, "--served-model-name: 'my model'"),
        ({"served_model_name": ["a", "a"]}, "--served-model-name: a name is given twice"),
        ({"served_model_name": ["a"], "served_text_model_name": ["a"]}, "both towers"),
        ({"output_name": ""}, "--output-name"),
    ],
)
def test_invalid_values_name_the_flag(flags: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(flags, {})


def test_invalid_env_value_names_flag_and_variable() -> None:
    with pytest.raises(ConfigError, match="CLIPSERVE_PORT"):
        load_config({}, {"CLIPSERVE_PORT": "eighty"})


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("clipserve: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_missing_checkpoint_fails_with_one_line(tiny_config: Path, tmp_path: Path) -> None:
    line = one_line_error(
        run_clipserve("--model", str(tiny_config), "--checkpoint", str(tmp_path / "nope.pt"))
    )
    assert "--checkpoint" in line and "does not exist" in line


def test_checkpoint_of_another_architecture_fails_with_one_line(
    tiny_config: Path, tmp_path: Path
) -> None:
    other = tmp_path / "wider.json"
    other.write_text(
        tiny_config.read_text().replace('"width": 64, "head_width"', '"width": 96, "head_width"')
    )
    ckpt = write_checkpoint(other, tmp_path / "wider.safetensors", seed=0)
    line = one_line_error(run_clipserve("--model", str(tiny_config), "--checkpoint", str(ckpt)))
    assert "does not fit --model" in line


def test_a_config_open_clip_cannot_build_blames_the_model_not_the_weights(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-clip.json"
    broken.write_text(tiny_config.read_text().replace("{", '{"no_such_field": 1, ', 1))
    line = one_line_error(
        run_clipserve("--model", str(broken), "--checkpoint", str(tiny_checkpoint))
    )
    assert f"--model {broken}: could not build" in line and "--pretrained" not in line


def test_unfetchable_pretrained_weights_fail_with_one_line(tiny_config: Path) -> None:
    line = one_line_error(run_clipserve("--model", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k"))
    assert "--checkpoint" in line and "--pretrained none" in line


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--model", "ViT-Nope"], "--model"),
        # A process each (~7 s): the default run keeps one, CI runs the rest (make test-slow).
        pytest.param(
            ["--precision", "fp16", "--gpus", "cpu", "--backend", "torch"],
            "--precision fp16",
            marks=pytest.mark.slow,
        ),
        pytest.param(["--backend", "tensorflow"], "--backend", marks=pytest.mark.slow),
        pytest.param(["--gpus", "3", "--backend", "torch"], "--gpus", marks=pytest.mark.slow),
        (["--max-batch-size", "0"], "--max-batch-size"),
    ],
)
def test_bad_startup_arguments_fail_with_one_line(
    tiny_config: Path, tiny_checkpoint: Path, args: list[str], named: str
) -> None:
    base = ["--model", str(tiny_config), "--checkpoint", str(tiny_checkpoint)]
    if args[0] == "--model":
        base = []
    assert named in one_line_error(run_clipserve(*base, *args))


def test_sigterm_drains_in_flight_requests(
    tiny_config: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    args = [
        "--model",
        str(tiny_config),
        "--checkpoint",
        str(tiny_checkpoint),
        "--backend",
        "fake",
        "--backend-option",
        "latency_ms=400",
        "--max-batch-size",
        "2",
        "--drain-timeout-s",
        "10",
    ]
    with cli_server(args, tmp_path / "server.log") as (proc, url):

        async def load() -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = png_bytes(random_pixels(1))
                tasks = [
                    asyncio.create_task(client.post("/embed", content=body, headers=PNG))
                    for _ in range(4)
                ]
                # A sleep: the server is another process and shows no count of requests in
                # flight to wait on; 0.2 s (half a batch) lets all four arrive before SIGTERM.
                await asyncio.sleep(0.2)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                codes = [(await t).status_code for t in tasks]
                assert time.monotonic() - t0 < 5
                return codes

        assert asyncio.run(load()) == [200, 200, 200, 200]  # 4 images, 2 batches of 400 ms
        assert proc.wait(timeout=15) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/healthz")  # no longer accepting


def test_readme_configuration_table_lists_every_option() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for option in iter_options():
        assert f"| `{option.flag}` | `{option.env}` |" in readme, option.flag


def test_boolean_option_from_flag_and_env() -> None:
    assert build_parser().parse_args(["--compile"]).compile == "true"
    assert load_config({"compile": "true"}, {}).backend.compile is True
    assert load_config({}, {"CLIPSERVE_COMPILE": "yes"}).backend.compile is True
    assert load_config({}, {"CLIPSERVE_COMPILE": "0"}).backend.compile is False
    with pytest.raises(ConfigError, match="--compile"):
        load_config({}, {"CLIPSERVE_COMPILE": "maybe"})
