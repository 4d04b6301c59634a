#!/usr/bin/env bash
# Before a GPU session, here: what the device tool's machine lacks, in two folders
# of this checkout that .gitignore keeps out of git and a `run` carries (carry: [".whl", ".devcarry"]).
#
#   .whl        cp312 wheels of formcast's dependencies missing there (xgrammar,
#               pydantic, ...), each at the version this checkout's .venv holds,
#               of setuptools, which builds formcast there, and of py-spy (for
#               benchmarks/host_profile.py; device_env.sh puts it on PATH)
#   .devcarry/tok  our tokenizer's files (the model's GGUF is too large to travel)
#
# Then each device call begins with `. benchmarks/device_env.sh &&` (see there).
#
#   make install && benchmarks/device_prep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# (the device's image has torch, numpy, tokenizers, safetensors, jinja2, tqdm,
# transformers and triton; these it lacks)
names="xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types typing-inspection gguf
       jsonschema jsonschema-specifications referencing rpds-py lark setuptools"
pins=$("$PY" - $names <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PY
)
rm -rf .whl
mkdir -p .whl
for pin in $pins; do  # (one at a time: a platform tag that fits one need not fit all)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$pin"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
    -d .whl "py-spy==0.4.3"
"$PY" -c "
from formcast.engine.hub import resolve_model
from formcast.engine.tokenizer import Tokenizer
Tokenizer.from_gguf(resolve_model('smollm2').path).save_pretrained('.devcarry/tok')"
du -sh .whl .devcarry/tok
