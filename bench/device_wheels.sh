#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels a bare GPU machine lacks for bench/gpu.sh:
# what engine/, punica_kernels/, bench/ and tests/punica_kernels import beyond that image's torch,
# triton, numpy, safetensors, tokenizers, jinja2, transformers and peft. Run here (where PyPI is
# reachable), from the repository root, before a device run that names `.whl` in `carry`.
#
#   gguf               engine/loader (reads the checkpoints), engine/loader/synthetic.py (writes them)
#   pydantic (+ pydantic-core, annotated-types, typing-inspection, typing-extensions)
#                      engine/sampling_params.py
#   prometheus-client  engine/metrics.py
#   pytest (+ pluggy, iniconfig, packaging, pygments), hypothesis (+ sortedcontainers)
#                      tests/punica_kernels
# gguf's own needs (numpy, pyyaml, requests, tqdm) are transformers' too, so the image has them.
# Versions are this project's (the ones its .venv runs); one version of each, or the install
# there stops. CPython 3.12 on x86-64 (the device machine), whatever this machine is.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  gguf==0.19.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  prometheus-client==0.26.0
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3 pygments==2.21.0
  hypothesis==6.170.17 sortedcontainers==2.4.0
)

mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls .whl/*.whl | wc -l | xargs echo "wheels in .whl:"
du -sh .whl
