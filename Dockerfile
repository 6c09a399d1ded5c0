# GPU image for clusters: CUDA PyTorch, flash-attn, torchao and this project (docs/docker.md).
#
#   docker build -t pretrain-recipes .
#   docker run --gpus all --ipc=host -v $PWD/runs:/workspace/runs -v $PWD/data:/workspace/data \
#       pretrain-recipes +recipe=gpt2-124m
#
# The base is the official PyTorch CUDA "devel" image: it carries nvcc, which flash-attn
# needs to compile when no prebuilt wheel matches. Its torch is the version the project is
# tested with (README's `pip install torch==2.13.0`, whose Linux wheel is built for CUDA
# 13.0). Any image with that torch and a CUDA toolkit works, an NGC PyTorch image too:
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:YY.MM-py3 \
#                --build-arg TORCH_VERSION=<its torch version> -t pretrain-recipes .
ARG TORCH_VERSION=2.13.0
ARG BASE_IMAGE=pytorch/pytorch:${TORCH_VERSION}-cuda13.0-cudnn9-devel
FROM ${BASE_IMAGE}

ARG TORCH_VERSION
# Pinned so a rebuild gets the same kernels; torchao is the version tested with torch 2.13.0.
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG TORCHAO_VERSION=0.18.0
# flash-attn compiles for these GPU architectures only (80: A100, 90: H100/H200; add 100
# for B200). Each nvcc job can take several GB of RAM: raise MAX_JOBS on a big build host.
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=4
ARG NVCC_THREADS=2

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# pip must never replace the base image's CUDA torch (a resolution that picks another build
# would silently change the CUDA stack): stop here if the base has another torch than
# TORCH_VERSION or a CPU build, then pin torch, as pip sees it installed, in a constraints
# file that every later pip command obeys (PIP_CONSTRAINT; a constraints file the base
# image already had, as NGC images do, is kept in it).
RUN python -c "import sys, torch; v = torch.__version__; \
sys.exit(None if v.startswith('${TORCH_VERSION}') and torch.version.cuda else \
f'the base image has torch {v} (CUDA {torch.version.cuda}), not the CUDA build of \
${TORCH_VERSION}: pick another BASE_IMAGE or set TORCH_VERSION')" \
 && { if [ -f "${PIP_CONSTRAINT:-}" ]; then cat "$PIP_CONSTRAINT"; fi; \
      python -c "from importlib.metadata import version; print('torch==' + version('torch'))"; \
    } > /etc/pip-constraints.txt \
 && cat /etc/pip-constraints.txt
ENV PIP_CONSTRAINT=/etc/pip-constraints.txt

# flash-attn first, in a layer of its own (the slow one: tens of minutes when it compiles).
# --no-build-isolation builds against the installed torch instead of a fresh one from PyPI;
# its build needs ninja, packaging and psutil present.
RUN pip install ninja packaging psutil wheel einops \
 && FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
    NVCC_THREADS="${NVCC_THREADS}" \
    pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" \
 && pip install "torchao==${TORCHAO_VERSION}"

WORKDIR /workspace
# The project's dependencies next, from pyproject.toml alone, so editing the code does not
# reinstall them; then the code itself (editable: a checkout mounted over /workspace runs).
COPY pyproject.toml README.md ./
RUN mkdir -p src/pretrain && touch src/pretrain/__init__.py \
 && pip install -e '.[gpu,slurm]'
COPY . .
RUN pip install --no-deps -e . \
 && python -c "import torch, flash_attn, torchao, pretrain; \
print('torch', torch.__version__, 'flash-attn', flash_attn.__version__, 'torchao', torchao.__version__)"

# Allocator segments that grow in place (less fragmentation at high memory use), as
# slurm/train.sbatch sets it; a run's environment may override it.
ENV PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
ENTRYPOINT ["python", "train.py"]
CMD []
