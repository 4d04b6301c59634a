# On the device tool's machine, sourced at the start of a call that carries
# .whl and .devcarry (made here by benchmarks/device_prep.sh):
#
#   . benchmarks/device_env.sh && python3 benchmarks/gpu_throughput.py --tokenizer-dir .devcarry/tok
#
# installs the carried wheels into /tmp/site and formcast (this tree, built
# there) into /tmp/fc, both first on PYTHONPATH, and points the CUDA tests at the
# carried tokenizer (FORMCAST_TOKENIZER_DIR). Fails (returns non-zero) when an
# install does.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl &&
export PYTHONPATH=/tmp/site &&
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/fc . &&
export PYTHONPATH=/tmp/fc:/tmp/site FORMCAST_TOKENIZER_DIR=$PWD/.devcarry/tok PYTHONUNBUFFERED=1 \
    PATH=/tmp/site/bin:$PATH
