#!/usr/bin/env bash
# `make docker-test`: the images built and run for real (10-20 minutes; not part of `make test`).
#  1. base: BASE_IMAGE (python:3.11-slim) pulled, else made here by docker/base.sh (debootstrap)
#  2. the CPU image, with PyTorch's CPU index or, where it is out of reach, PyPI's torch
#  3. a tiny random-weight model and a JPEG, written by the image itself into a mounted folder
#  4. the server as the image's non-root user, set up as the Kubernetes CPU pod is (read-only
#     root, /tmp and /cache writable, every capability dropped, --workers 2, JSON logs), the
#     model chosen by CLIPSERVE_* variables; waits for the HEALTHCHECK's 'healthy'
#  5. a JPEG to /embed, a text to /v1/embeddings, /metrics scraped (docker/probe.py)
#  6. SIGTERM under load: every request sent is answered, the exit code is 0
#  7. the CUDA image built the same way; `clipserve doctor --gpus cpu` recorded, and its server
#     started with --gpus cpu until healthy and stopped (SKIP_CUDA=1 leaves this out)
#  8. in each running image, every installed package that constraints.txt pins is at its pin
#     (the Dockerfiles install under it); the rest is listed as unpinned
# Writes $OUT (JSON: sizes, build times, time to ready, drain) and $LOG (this run's output).
# Where no Docker engine answers it says so and exits 0: nothing is checked then.
# Environment: DOCKER (the client), BASE_IMAGE, CUDA_BASE_IMAGE, PIP_INDEX_URL, TORCH_INDEX_URL,
# CA_BUNDLE (pip's CA bundle, given to builds as a secret), SKIP_CUDA, KEEP_BUILD_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER=${DOCKER:-docker}
OUT=${OUT:-bench/results/docker-test.json}
LOG=${LOG:-bench/results/docker-test.log}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
CUDA_BASE_IMAGE=${CUDA_BASE_IMAGE:-nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04}
LOCAL_BASE=clipserve-base:bookworm
PIP_INDEX_URL=${PIP_INDEX_URL:-https://pypi.org/simple}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
export DOCKER

if ! "$DOCKER" info >/dev/null 2>&1; then
  echo "docker-test: SKIPPED: no Docker engine answers ('$DOCKER info' failed); nothing checked"
  exit 0
fi
mkdir -p "$(dirname "$OUT")" "$(dirname "$LOG")"
failures=()
exec > >(tee "$LOG") 2>&1

say() { echo "docker-test: $(date -u +%H:%M:%S) $*"; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round($(now) - $1, 1))"; }
# Installed versions against constraints.txt (mounted at /models), run inside an image: a torch
# X+cpu holds to a pin X, as pip's matching does.
held_py="
import json, re
from importlib.metadata import distributions
def norm(n): return re.sub(r'[-_.]+', '-', n).lower()
pins = {norm(k): v for k, v in (l.strip().split('==', 1) for l in open('/models/constraints.txt')
                                if '==' in l and not l.startswith('#'))}
got = {norm(d.metadata['Name']): d.version for d in distributions()}
print(json.dumps({'file': 'constraints.txt', 'pins': len(pins), 'installed': len(got),
    'held': sum(n in pins for n in got),
    'off_pin': {n: [v, pins[n]] for n, v in sorted(got.items())
                if n in pins and v.split('+')[0] != pins[n]},
    'unpinned': sorted(n for n in got if n not in pins and n != 'clipserve'),
    'versions': {n: got.get(n) for n in ('torch', 'torchvision', 'numpy', 'onnxruntime-gpu',
                                         'onnxruntime', 'pillow', 'uvicorn', 'open-clip-torch')}}))
"
free_port() { python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# BuildKit: the Dockerfiles mount secrets and the build stage's wheels.
if "$DOCKER" buildx version >/dev/null 2>&1; then
  build() { nice -n 19 "$DOCKER" buildx build --load --progress plain "$@"; }
elif [ "$("$DOCKER" version -f '{{.Client.Version}}' | cut -d. -f1)" -lt 23 ]; then
  build() { DOCKER_BUILDKIT=1 BUILDKIT_PROGRESS=plain nice -n 19 "$DOCKER" build "$@"; }
else
  say "FAILED: no BuildKit: install the buildx plugin, or set DOCKER to a client before 23 (e.g. Debian 12's docker.io, /usr/bin/docker)"
  exit 1
fi

# The default base where it can be had, else a local Debian one.
base_for() {
  if "$DOCKER" image inspect "$1" >/dev/null 2>&1 || "$DOCKER" pull -q "$1" >/dev/null 2>&1; then
    echo "$1"
  else
    echo "docker-test: $1 cannot be pulled: using $LOCAL_BASE from docker/base.sh" >&2
    docker/base.sh "$LOCAL_BASE" >&2
    echo "$LOCAL_BASE"
  fi
}

secret=()
[ -s "$CA_BUNDLE" ] && secret=(--secret "id=ca,src=$CA_BUNDLE")
torch_note="PyTorch's CPU index"
if ! curl -fsS -m 15 -o /dev/null "$TORCH_INDEX_URL/torch/"; then
  torch_note="PyPI's CUDA build: $TORCH_INDEX_URL is out of reach from here"
  TORCH_INDEX_URL=$PIP_INDEX_URL
fi

cpu_base=$(base_for "$BASE_IMAGE")
say "building clipserve:cpu on $cpu_base; torch from $torch_note"
t=$(now)
build -f docker/Dockerfile.cpu --network host -t clipserve:cpu "${secret[@]}" \
  --build-arg BASE_IMAGE="$cpu_base" --build-arg PIP_INDEX_URL="$PIP_INDEX_URL" \
  --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" .
cpu_build_s=$(since "$t")
cpu_size=$("$DOCKER" image inspect -f '{{.Size}}' clipserve:cpu)
cpu_user=$("$DOCKER" image inspect -f '{{.Config.User}}' clipserve:cpu)
say "clipserve:cpu: $cpu_size bytes, built in $cpu_build_s s, user $cpu_user"
[ "$cpu_user" = clipserve ] || { say "FAILED: the image runs as '$cpu_user'"; exit 1; }

models=$(mktemp -d /var/tmp/clipserve-docker-test.XXXXXX)
name=clipserve-docker-test-$$
cleanup() {
  for c in "$name" "$name-cuda"; do
    if "$DOCKER" inspect "$c" >/dev/null 2>&1; then
      "$DOCKER" logs "$c" 2>&1 | tail -n 30 | sed "s/^/$c: /"
    fi
  done
  "$DOCKER" rm -f "$name" "$name-cuda" >/dev/null 2>&1 || true
  rm -rf "$models"
}
trap cleanup EXIT
chmod 755 "$models"
install -m 644 constraints.txt "$models/constraints.txt"
say "writing the tests' tiny model (random weights) and a JPEG with the image"
"$DOCKER" run --rm --network none --user 0 -v "$models:/models" --entrypoint python clipserve:cpu -c "
import json, os, open_clip, torch
from PIL import Image
from safetensors.torch import save_file
from clipserve.loadgen.procs import TINY_CONFIG
json.dump(TINY_CONFIG, open('/models/tiny-clip.json', 'w'))
open_clip.add_model_config('/models/tiny-clip.json')
torch.manual_seed(1234)
model = open_clip.create_model('tiny-clip', pretrained=None)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, '/models/tiny.safetensors')
os.chmod('/models/tiny.safetensors', 0o644)
pixels = (torch.rand(480, 640, 3, generator=torch.Generator().manual_seed(0)) * 255).byte()
Image.fromarray(pixels.numpy()).save('/models/photo.jpg', quality=90)
"

# As the Kubernetes CPU pod runs it (docker/k8s/base/deployment.yaml, k8s/cpu/clipserve.env).
serve() { # image name port grpc_port [args...]
  local image=$1 cname=$2 port=$3 gport=$4
  shift 4
  "$DOCKER" run -d --name "$cname" --network host --read-only --cap-drop ALL \
    --tmpfs /tmp --tmpfs /cache:mode=1777 --shm-size 1g -v "$models:/models:ro" \
    -e CLIPSERVE_HOST=127.0.0.1 -e CLIPSERVE_PORT="$port" -e CLIPSERVE_GRPC_PORT="$gport" \
    -e CLIPSERVE_MODEL=/models/tiny-clip.json -e CLIPSERVE_CHECKPOINT=/models/tiny.safetensors \
    -e CLIPSERVE_BACKEND=torch -e CLIPSERVE_WORKERS=2 -e CLIPSERVE_THREADS=1 \
    -e CLIPSERVE_DECODE_WORKERS=1 -e CLIPSERVE_LOG_FORMAT=json -e CLIPSERVE_DRAIN_TIMEOUT_S=30 \
    -e CLIPSERVE_CACHE_DIR=/cache/clipserve -e HF_HOME=/cache/huggingface \
    -e XDG_CACHE_HOME=/cache -e TRITON_CACHE_DIR=/cache/triton \
    "$image" "$@" >/dev/null
}
port=$(free_port)
gport=$(free_port)
say "starting clipserve:cpu on 127.0.0.1:$port (gRPC :$gport)"
t=$(now)
serve clipserve:cpu "$name" "$port" "$gport"
# `docker run` itself: on a vfs engine it copies the whole image first.
run_s=$(since "$t")
ready=$(python3 docker/probe.py ready "$port" "$name" "$DOCKER")
say "ready: $ready"
whoami=$("$DOCKER" exec "$name" id -un)
[ "$whoami" = clipserve ] || { say "FAILED: the server runs as '$whoami'"; exit 1; }
checks=$(python3 docker/probe.py check "$port" "$models/photo.jpg")
say "checks: $checks"
held=$("$DOCKER" exec "$name" python -c "$held_py")
say "against constraints.txt: $held"
off_pin() { python3 -c 'import json, sys; sys.exit(bool(json.loads(sys.argv[1])["off_pin"]))' "$1"; }
off_pin "$held" || failures+=("clipserve:cpu has packages off constraints.txt")
say "SIGTERM under load"
drain=$(python3 docker/probe.py drain "$port" "$models/photo.jpg" "$name" "$DOCKER") \
  || failures+=("SIGTERM under load")
[ -n "$drain" ] || drain=null
# Requests the app itself logged: where it equals the 200s, a lost request never reached it.
served=$("$DOCKER" logs "$name" 2>&1 | grep -c '"logger": "clipserve.access".*"route": "/embed"' || true)
say "drain: $drain; /embed requests in the access log: $served (1 before the load)"
"$DOCKER" logs "$name" 2>&1 | tail -n 12
"$DOCKER" rm "$name" >/dev/null

cuda='null'
if [ "${SKIP_CUDA:-0}" != 1 ]; then
  [ "${KEEP_BUILD_CACHE:-0}" = 1 ] || "$DOCKER" builder prune -af >/dev/null
  cuda_base=$(base_for "$CUDA_BASE_IMAGE")
  say "building clipserve:cuda on $cuda_base"
  t=$(now)
  build -f docker/Dockerfile.cuda --network host -t clipserve:cuda "${secret[@]}" \
    --build-arg BASE_IMAGE="$cuda_base" --build-arg PIP_INDEX_URL="$PIP_INDEX_URL" .
  cuda_build_s=$(since "$t")
  cuda_size=$("$DOCKER" image inspect -f '{{.Size}}' clipserve:cuda)
  say "clipserve:cuda: $cuda_size bytes, built in $cuda_build_s s"
  port=$(free_port)
  gport=$(free_port)
  say "starting clipserve:cuda with --gpus cpu on 127.0.0.1:$port"
  serve clipserve:cuda "$name-cuda" "$port" "$gport" --gpus cpu
  cuda_ready=$(python3 docker/probe.py ready "$port" "$name-cuda" "$DOCKER")
  cuda_checks=$(python3 docker/probe.py check "$port" "$models/photo.jpg")
  say "ready: $cuda_ready; checks: $cuda_checks"
  cuda_held=$("$DOCKER" exec "$name-cuda" python3 -c "$held_py")
  say "against constraints.txt: $cuda_held"
  off_pin "$cuda_held" || failures+=("clipserve:cuda has packages off constraints.txt")
  # doctor in the running container: no second multi-GB copy of the image on a vfs engine.
  doctor_rc=0
  doctor=$("$DOCKER" exec "$name-cuda" clipserve doctor --gpus cpu --backend torch \
    --model /models/tiny-clip.json --checkpoint /models/tiny.safetensors) || doctor_rc=$?
  printf '%s\n' "$doctor"
  "$DOCKER" kill --signal TERM "$name-cuda" >/dev/null
  cuda_exit=$("$DOCKER" wait "$name-cuda")
  "$DOCKER" rm "$name-cuda" >/dev/null
  say "doctor exit $doctor_rc; server exit code $cuda_exit after SIGTERM"
  [ "$cuda_exit" = 0 ] || failures+=("the CUDA image's server exited $cuda_exit after SIGTERM")
  cuda=$(python3 -c "import json, sys; print(json.dumps({
    'base_image': sys.argv[1], 'image_bytes': int(sys.argv[2]), 'build_s': float(sys.argv[3]),
    'gpus': 'cpu', **json.loads(sys.argv[4]), 'checks': json.loads(sys.argv[5]),
    'exit_code_after_sigterm': int(sys.argv[6]), 'doctor_exit_code': int(sys.argv[7]),
    'doctor': sys.argv[8].splitlines(), 'constraints': json.loads(sys.argv[9])}))" \
    "$cuda_base" "$cuda_size" "$cuda_build_s" "$cuda_ready" "$cuda_checks" "$cuda_exit" \
    "$doctor_rc" "$doctor" "$cuda_held")
fi
[ "${KEEP_BUILD_CACHE:-0}" = 1 ] || "$DOCKER" builder prune -af >/dev/null

python3 - "$OUT" "$cpu_base" "$torch_note" "$cpu_size" "$cpu_build_s" "$run_s" "$ready" "$checks" \
  "$drain" "$served" "$cuda" "$(IFS=';'; echo "${failures[*]}")" "$("$DOCKER" version -f '{{.Server.Version}}')" "$("$DOCKER" info -f '{{.Driver}}')" \
  "$held" <<'EOF'
import json, os, platform, sys, time
(out, base, torch_from, size, build_s, run_s, ready, checks, drain, served, cuda, failures,
 server, driver, held) = sys.argv[1:]
record = {
    "what": "docker/test.sh: the images built and run on this host",
    "passed": not failures,
    "failures": failures.split(";") if failures else [],
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "docker_server": server,
             "storage_driver": driver},
    "cpu": {"base_image": base, "torch_from": torch_from, "image_bytes": int(size),
            "build_s": float(build_s), "user": "clipserve",
            "model": "the tests' tiny open_clip config, random weights; --workers 2",
            "docker_run_s": float(run_s), **json.loads(ready), "checks": json.loads(checks),
            "sigterm_under_load": json.loads(drain),
            "embed_requests_in_access_log": int(served), "constraints": json.loads(held)},
    "cuda": json.loads(cuda),
}
with open(out, "w") as f:
    json.dump(record, f, indent=1)
    f.write("\n")
EOF
if [ ${#failures[@]} -gt 0 ]; then
  say "FAILED: ${failures[*]} ($OUT, log $LOG)"
  exit 1
fi
say "PASSED: $OUT, log $LOG"
