"""One command on a CUDA machine: every GPU path, measured, into one JSON.

    python -m bench.gpu_check [--workers 1 [--reuse-port]] [--budget-s S]  (or: make gpu-check)
    python -m bench.gpu_check --allow-cpu --quick                   (no GPU: the tiny model)

Sections, each in its own process with its own time limit (a CUDA error or a hang in one cannot
take the others down; one that fails or runs out of time is recorded with its log's tail and
whatever it measured so far, and the run goes on):
  env               versions, the GPU, which optional packages import
  gpu-tests         `pytest -m gpu` over the test files that hold GPU tests; on CUDA the decode
                    and executor tests again under TORCH_CUDA_SANITIZER=1
  executor:<name>   offline sweep, batch 1..1024, FP16: torch eager, torch.compile, cuda-graphs,
                    ort-cuda, ort-trt (where onnxruntime-gpu lists their providers)
  pipelined:<name>  torch FP16, torch FP32, cuda-graphs (the CPU: torch): run() one batch at a
                    time against launch/wait with K = 1, 2, 3 batches in flight and the
                    pipelined worker in-process at --pipeline-depth K; images/s, per-batch
                    latency and the ratio to run() (medians of interleaved rounds, min-max),
                    batches of 16, 64, 256; launch/wait's and the worker's rows against run()'s
                    (cosine >= 0.9999, or the section fails)
  decoders          nvJPEG (inference/gpu_decode.py) against Pillow per core, 640x480 JPEGs; one
                    batch over 2^27 pixels (chunked) checked row by row against single decodes;
                    the corrupt JPEG corpus (tests/inference/corrupt_jpeg.py), each refused;
                    a decode process per device (several GPUs), its crops back through CUDA
                    IPC equal to this process's, on a second GPU too where there is one
  served:tensor-dN  served uint8-tensor rate through clipserve-bench and the device-busy ratio
                    (Δ clipserve_device_busy_seconds / wall, else Δ batch time / wall), one per
                    --pipeline-depth given where the server has that flag
  served:single     served single-image uint8-tensor requests/s (512 in flight): where one
                    engine's loop, not the device, sets the rate (every served section records
                    the cores busy by role, the engine's loop thread, the load generator and
                    the host over device_busy's window: cores_busy)
  served:jpeg       served JPEG rate (with --decode gpu where the server has that flag)
The whole run keeps within --budget-s (default: the sum of the sections' limits, so none is
skipped for time unless asked): a section starts with what is left
of its own limit and the budget, and is skipped when too little is left. Writes
bench/results/gpu-check-<gpu>-<date>.json (cpu-<cpu> without a GPU).

On the lent H100/H200 hosts (no network there; their image has torch, torchvision, onnx,
onnxruntime (CPU), numpy, pillow, aiohttp, msgpack, prometheus-client, anyio, h11, click, httpx,
pytest, pytest-timeout, uvloop, regex, timm, huggingface-hub, safetensors), carry this wheel set
(14 wheels, 13 MB; grpcio and protobuf at the versions tritonclient's protos need), downloaded
here at the repository root first:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \\
      starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 open_clip_torch==3.3.0 ftfy==6.3.1 \\
      wcwidth==0.9.4 orjson==3.13.0 python-multipart==0.0.34 hdrhistogram==0.10.8 \\
      simplejpeg==1.9.0 tritonclient==2.73.0 protobuf==6.33.6 grpcio==1.85.3 \\
      python-rapidjson==1.25
    # optional (ort-cuda; 255 MB, over one call's 64 MiB carry limit alone): onnxruntime-gpu

and run it there (device tool: carry [".whl"]), each call's command starting with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit

A session has 15 minutes of device time, a machine's start included, so choose sections with
--only and --skip and give each call a --budget-s; copy each call's JSON from $OUT and join them
here (--merge). The first run (2026-11-27, bench/results/gpu-check-h100-*.json and -h200-*.json)
took three calls: env,gpu-tests,executor:torch+fp16,executor:cuda-graphs,served:tensor-d2 with
--skip executor:torch+fp16+compile (a 315 s budget); served:tensor-d2, then
decoders,served:jpeg (270 s); served:tensor-d2 with --workers 4 (120 s). Measured there:
gpu-tests 160 s, an executor sweep 25-30 s, a served section 50-110 s (of it, up to a minute of
clipserve-bench building tensor payloads, since cut to seconds), decoders 56 s. The second run
(bench/results/gpu-check-h200-2026-11-27-second-run.json) took four calls: env,gpu-tests,
pipelined:torch+fp16,served:tensor-d2 (--pipeline-depths 2, 490 s budget; 281 s used), then at
once on the warm machine executor:torch+fp16+compile (79 s), gpu-tests again after a fix (129 s)
and served:tensor-d2 with --workers 4 (70 s). Each section's whole pytest output is kept beside
its JSON (gpu-tests-pytest.log, sanitizer-pytest.log): copy them from the run's directory to
$OUT too. Not yet run: ort-cuda and ort-trt (onnxruntime-gpu does not fit a call).

clipserve itself runs from the working tree (the repository root is the working directory).
"""
