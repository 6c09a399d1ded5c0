#!/usr/bin/env bash
# On a machine with the package index, before a GPU session: fills the checkout's ignored
# .gpu/ with what the GPU machine (its own CUDA torch 2.11, Python 3.12, no network) lacks:
# .gpu/whl/ the wheels of this project's requirements beside torch, torchao, and torchtitan
# 0.3.0 with its requirements. nanoGPT's three files go in .gpu/peer/ by hand (README.md).
#   bash benchmarks/gpu/prepare.sh            (PY=3.12 by default; about 40 MB)
set -eu
W=.gpu/whl; mkdir -p $W .gpu/peer
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
--platform manylinux2014_x86_64 --platform any"
dl() { pip download -q --no-deps --only-binary=:all: --python-version "${PY:-3.12}" \
  --implementation cp $PLAT -d $W "$@"; }
# this project's requirements that a CUDA torch image lacks
# (the versions this project's CPU venv has, where they matter; torchao 0.17 is the last for
# torch 2.11)
dl hydra-core==1.3.8 omegaconf==2.3.1 torchao==0.17.0 wandb==0.31.0 cwevals==0.0.1b1 \
  opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-otlp-proto-http \
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-http-transport \
  opentelemetry-exporter-otlp-common opentelemetry-semantic-conventions \
  googleapis-common-protos httpcore2 httpx2 truststore datasets dill multiprocess \
  pydantic pydantic-core annotated-types typing-inspection platformdirs
# torchtitan 0.3.0 and what it requires beside torch, datasets, tokenizers, safetensors
dl torchtitan==0.3.0 torchdata torch_checkpointing spmd_types==0.2.3 tyro docstring-parser \
  typeguard shtab rich markdown-it-py mdurl pygments einops tensorboard \
  tensorboard-data-server absl-py markdown werkzeug grpcio pillow
pip wheel -q --no-deps -w $W antlr4-python3-runtime==4.9.3   # an sdist only
ls $W | wc -l; du -sh $W
for f in model.py train.py configurator.py; do
  [ -f .gpu/peer/$f ] || echo "missing .gpu/peer/$f: nanoGPT's (README.md: how to fetch it)"
done
