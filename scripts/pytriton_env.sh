#!/usr/bin/env bash
# PyTriton (Triton's server and Python backend in a wheel) for bench/frontend's cost section,
# apart from the project's environment. Its Python backend stub links the system's
# libpython3.X.so but imports the stdlib of the interpreter that runs the model: they must be
# the same build, so the venv is made from the system Python whose libpython it links (Debian's
# /usr/bin/python3; pyenv's 3.11.7 stdlib fails in the stub: RLock._recursion_count).
#
#   scripts/pytriton_env.sh [DIR]      # default .pytriton; `make pytriton-env`
set -euo pipefail
dir=$(realpath -m "${1:-.pytriton}")
python=${PYTRITON_BASE_PYTHON:-/usr/bin/python3}
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import pytriton" 2>/dev/null; then
  echo "PyTriton ready: $dir/bin/python"
  exit 0
fi
"$python" -m venv "$dir"
"$dir/bin/python" -m pip install --quiet "nvidia-pytriton==0.7.0"
"$dir/bin/python" -c "import pytriton" && echo "PyTriton ready: $dir/bin/python"
