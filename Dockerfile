# GPU image for clusters: CUDA PyTorch, flash-attn, torchao and this project.
#
#   docker build -t pretrain-recipes .
#   docker run --gpus all --ipc=host -v $PWD/runs:/workspace/runs -v $PWD/data:/workspace/data \
#       pretrain-recipes +recipe=gpt2-124m
#
# The official PyTorch CUDA "devel" image carries nvcc, which flash-attn needs when no
# prebuilt wheel matches. Pin the same torch version the project is tested with.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    MAX_JOBS=8 \
    WANDB_MODE=offline

WORKDIR /workspace
# Dependencies first, so editing the code does not rebuild flash-attn.
COPY pyproject.toml README.md ./
RUN mkdir -p src/pretrain && touch src/pretrain/__init__.py \
 && pip install --no-build-isolation -e '.[gpu,slurm]' \
 && python -c "import flash_attn, torchao; print('flash-attn', flash_attn.__version__, 'torchao', torchao.__version__)"
COPY . .
RUN pip install --no-deps -e .

ENTRYPOINT ["python", "train.py"]
CMD []
