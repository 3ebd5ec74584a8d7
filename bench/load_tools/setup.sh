#!/usr/bin/env bash
# Installs three third-party load tools, each in its own venv under /tmp, at pinned versions:
#   /tmp/tool-aiperf           aiperf 0.13.0          (NVIDIA)
#   /tmp/tool-guidellm         guidellm 0.8.1         (vLLM project; pulls torch: the CPU 2.13.0
#                                                     wheel first, which this machine has for 3.11)
#   /tmp/tool-inference-perf   inference-perf 0.7.0   (Kubernetes SIG; needs Python >= 3.12)
# Idempotent: a venv whose tool already imports at the pinned version is left alone.
# PYTHON312 / PYTHON311 name the interpreters (default: on PATH, else pyenv's).
set -euo pipefail

find_python() {  # minor version -> a working interpreter's path (a pyenv shim may fail)
    local candidate
    for candidate in "python3.$1" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3."$1".*/bin/python3."$1"; do
        if "$candidate" --version >/dev/null 2>&1; then
            echo "$candidate"
            return
        fi
    done
    echo "setup.sh: no Python 3.$1 found; set PYTHON3$1=/path/to/python3.$1" >&2
    exit 1
}
PYTHON312=${PYTHON312:-$(find_python 12)}
PYTHON311=${PYTHON311:-$(find_python 11)}

install_tool() {  # python venv dist version [pre-installs...]
    local python=$1 venv=$2 dist=$3 version=$4
    shift 4
    if [[ -x "$venv/bin/python" ]] && [[ "$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$dist'))" 2>/dev/null)" == "$version" ]]; then
        echo "$dist $version already in $venv"
        return
    fi
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    if (($#)); then
        "$venv/bin/pip" install -q "$@"
    fi
    "$venv/bin/pip" install -q "$dist==$version"
    echo "$dist $version installed in $venv"
}

install_tool "$PYTHON312" /tmp/tool-aiperf aiperf 0.13.0
# guidellm depends on torch; without the CPU wheel first pip picks a CUDA build (several GB)
install_tool "$PYTHON311" /tmp/tool-guidellm guidellm 0.8.1 torch==2.13.0
torch_version=$(/tmp/tool-guidellm/bin/python -c "import torch; print(torch.__version__)")
if [[ $torch_version != *+cpu ]]; then
    echo "setup.sh: guidellm's venv got torch $torch_version, not a CPU build" >&2
    exit 1
fi
install_tool "$PYTHON312" /tmp/tool-inference-perf inference-perf 0.7.0
