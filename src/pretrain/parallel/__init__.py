"""Parallelism applied to the plain GPT from outside: one small module per technique.

layout (what the config asks for), rules (what makes a layout valid), mesh (process group
and DeviceMesh), pipeline, tensor parallel, activation checkpointing, data parallel (FSDP2 /
replicate), tied embeddings across stages, gradient clipping across meshes; ``apply``
composes them in order.
"""
