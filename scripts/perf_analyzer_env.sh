#!/usr/bin/env bash
# Triton's perf_analyzer, runnable here without Triton's container: the binary from the
# tritonclient 2.45.0 wheel (the last that ships it), libcudart.so.12 from NVIDIA's wheel (it
# links the CUDA runtime even for --shared-memory system) and Debian's libb64. Kept apart from
# the project's environment (whose tritonclient stays current): nothing is installed, the files
# are extracted into DIR and DIR/perf_analyzer runs the binary with them.
#
#   scripts/perf_analyzer_env.sh [DIR]      # default .perf-analyzer; `make perf-analyzer-env`
set -euo pipefail
dir=$(realpath -m "${1:-.perf-analyzer}")
python=${PYTHON:-python3}
if [ -x "$dir/perf_analyzer" ] && "$dir/perf_analyzer" --version >/dev/null 2>&1; then
  echo "perf_analyzer ready: $dir/perf_analyzer"
  exit 0
fi
mkdir -p "$dir/wheels" "$dir/lib" "$dir/bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$dir/wheels" \
  "tritonclient==2.45.0" "nvidia-cuda-runtime-cu12>=12.1,<13"
"$python" - "$dir" <<'PY'
import pathlib, shutil, sys, zipfile
out = pathlib.Path(sys.argv[1])
wanted = {"/bin/perf_analyzer": out / "bin", "/lib/libcudart.so.12": out / "lib"}
for wheel in (out / "wheels").glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            for suffix, target in wanted.items():
                if name.endswith(suffix):
                    dest = target / pathlib.Path(name).name
                    with z.open(name) as src, open(dest, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    dest.chmod(0o755)
PY
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d; then
  (cd "$tmp" && apt-get download libb64-0d >/dev/null)
  dpkg -x "$tmp"/libb64-0d_*.deb "$tmp/root"
  cp "$tmp"/root/usr/lib/*/libb64.so.0d* "$dir/lib/"
fi
cat >"$dir/perf_analyzer" <<SH
#!/bin/sh
LD_LIBRARY_PATH="$dir/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$dir/bin/perf_analyzer" "\$@"
SH
chmod +x "$dir/perf_analyzer"
"$dir/perf_analyzer" --version
echo "perf_analyzer ready: $dir/perf_analyzer"
