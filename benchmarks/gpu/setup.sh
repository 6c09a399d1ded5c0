# Sourced on the GPU machine (no network; its own CUDA torch): installs the wheels carried in
# .gpu/whl (made by benchmarks/gpu/prepare.sh on a machine with the package index) into
# /tmp/site and puts this checkout's src/ and benchmarks/gpu/ on the path.
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ -d .gpu/whl ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl > /tmp/site-install.log 2>&1 \
    && touch /tmp/site/.installed || { echo "wheel install failed:"; tail -3 /tmp/site-install.log; }
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks/gpu:/tmp/site
