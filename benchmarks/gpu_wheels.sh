#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py installs on a GPU machine with no package index:
# egglog (pinned as in pyproject.toml) and what `import egglog` imports, and lark, for
# Python 3.12 on x86-64 Linux. They land in .gpu_wheels/ (git-ignored; carry it to the device).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON_VERSION:-3.12}"
egglog=$(grep -o '"egglog==[^"]*"' pyproject.toml | tr -d '"')
mkdir -p .gpu_wheels
pip download -q --no-deps --only-binary=:all: --python-version "$python" -d .gpu_wheels \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    "$egglog" black pytokens platformdirs graphviz opentelemetry-api lark
du -sh .gpu_wheels
