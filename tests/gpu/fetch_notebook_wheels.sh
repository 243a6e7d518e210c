#!/usr/bin/env bash
# Download the wheels tests/gpu/test_gpu_notebooks.py needs on a GPU machine without a package index
# (Python 3.12, x86-64 manylinux) into .whl/ at the repository root. Run once where pip reaches PyPI; carry
# .whl to the GPU machine and install it there before the test:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -v -e '^#' -e '^[[:space:]]*$' tests/gpu/notebook-wheels.txt > .whl/requirements.txt
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux_2_26_x86_64 -d .whl -r .whl/requirements.txt
rm .whl/requirements.txt
du -sh .whl
