"""One command on a CUDA machine: every GPU path, measured, into one JSON.

    python -m bench.gpu_check [--workers 1] [--budget-s S]         (or: make gpu-check)
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
  served:jpeg       served JPEG rate (with --decode gpu where the server has that flag)
The whole run keeps within --budget-s (default: the sum of the sections' limits, so none is
skipped for time unless asked): a section starts with what is left
of its own limit and the budget, and is skipped when too little is left. Writes
bench/results/gpu-check-<gpu>-<date>.json (cpu-<cpu> without a GPU).

On the lent H100/H200 hosts (no network there; their image has torch, torchvision, onnx,
onnxruntime (CPU), onnxscript, numpy, pillow, aiohttp, msgpack, prometheus-client, anyio, h11,
click, httpx, pytest, pytest-timeout, uvloop, regex, timm, huggingface-hub, safetensors),
carry this wheel set (9 wheels, 3.4 MB; hdrhistogram's pbr and setuptools requirements are for
its build, not its import), downloaded here at the repository root first:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \\
      starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 open_clip_torch==3.3.0 ftfy==6.3.1 \\
      wcwidth==0.9.4 orjson==3.13.0 python-multipart==0.0.34 hdrhistogram==0.10.8
    # optional (ort-cuda; 255 MB, over one call's 64 MiB carry limit alone): onnxruntime-gpu

and run it there (device tool: carry [".whl"]). One call runs at most 10 minutes, so split the
sections with --only and join them with --merge, copying each call's JSON from $OUT into
bench/results/ before the next call (a section left out by the budget is listed "skipped"):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; \\
    PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --only env,gpu-tests,executor:torch \\
      --budget-s 570 --out $OUT/gpu-check.json
    # copy it to bench/results/gpu-check-h100.json, then, in the second call:
    ... python3 -m bench.gpu_check --only executor:cuda-graphs,decoders,served \\
      --budget-s 570 --merge bench/results/gpu-check-h100.json --out $OUT/gpu-check.json
    # and a third call the same way for --only pipelined (three sections, 150 s limits)

clipserve itself runs from the working tree (the repository root is the working directory).
"""
