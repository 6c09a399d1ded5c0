"""Activation memory: the tensors autograd saves for backward, per transformer layer and per
pipeline rank, following Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", arXiv:2205.05198, section 4 and Table 2).

Their accounting, 16-bit activations, micro batch b, sequence s, width h, a heads, TP size t:

    no parallelism                 s b h (34 + 5 a s / h)   bytes per layer
    TP (t)                         s b h (10 + 24/t + 5 a s / (h t))
    TP + sequence parallel         s b h (34/t + 5 a s / (h t))
    ... + selective recompute      the 5 a s / h term (softmax, its dropout) is gone
    full recompute                 2 s b h (the layer input only)

``korthikanti_layer_bytes`` is that table. ``layer_terms`` itemises the same tensors for this
repository's GPT as it really runs (measured with saved-tensor hooks, tests/test_estimate.py),
which differs from Megatron-LM in ways that matter at scale:

- Attention: flash-attn and SDPA save q, k, v, the output and a log-sum-exp (4 a s b bytes),
  never the s x s scores: the 5 a s / h term is absent whatever the checkpointing. The
  ``eager`` kernel keeps the softmax in fp32 plus its bf16 copy (6 a s^2 b bytes).
- Norm outputs: under CUDA autocast layer_norm/rms_norm run in fp32 (torch's autocast fp32
  list), so wq, wk and wv each cast the norm output to bf16 and save their own copy (3 copies,
  2 for a SwiGLU MLP's w1/w3). On CPU the norm runs in bf16 and one copy is shared, unless the
  residual stream is fp32 (below).
- Residual stream dtype: without FSDP / replicate (dp = 1) parameters stay fp32 under
  autocast, so the embedding output and every residual add are fp32: norm inputs and
  checkpointed block inputs cost 4 bytes per element instead of 2.
- Sequence parallel with DTensor: ``PrepareModuleInput`` all-gathers the norm output and the
  column-parallel linears would save the gathered (full-sequence) tensor; Megatron saves the
  shard and gathers again in backward. Every mode here keeps shards (``none`` under SP is a
  checkpoint policy too: parallel/activation_checkpoint.py), so ``sp_saves_gathered`` is
  only the accounting of DTensor without it.
- No dropout (the presets' default): no masks.

Pipeline in-flight microbatches per rank (each holding the rank's layers once):
GPipe all m; 1F1B min(m, p - r) on rank r (Narayanan et al. 2021, section 2.2: the first stage
holds p); interleaved 1F1B with v chunks (v - 1) p + 2 (p - 1 - r) + 1 chunk-microbatches of
L / (p v) layers (Megatron-LM's and torch's warm-up count, so rank 0 holds L (1 + (p-1)/(p v))
layers' worth, Korthikanti et al. section 4.2.3); ZB-V at most 2p chunks of L / (2p) layers,
the 1F1B peak (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config.schema import ModelConfig
from pretrain.model.gpt import ffn_token_width, padded_vocab_size
from pretrain.model.loss import chunk_rows, is_chunked
from pretrain.parallel.activation_checkpoint import (
    block_linears,
    recomputed_linears,
    sequence_parallel_kept,
)


@dataclass(frozen=True)
class ActivationSetup:
    """What decides the bytes one layer saves for one microbatch."""

    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    attention: str = "fused"  # fused (flash/SDPA) | eager (this repo's) | megatron (paper)
    compute_bytes: int = 2  # activation dtype: bf16/fp16 = 2, fp32 = 4
    residual_bytes: int = 2  # 4 when fp32 parameters feed autocast (no FSDP/replicate)
    norm_copies: bool = False  # each Linear casts the norm output itself (see module doc)
    sp_saves_gathered: bool = True  # DTensor SP: column-parallel inputs saved unsharded
    dropout: float = 0.0
    device: str = "cuda"  # cuda | cpu: which autocast rules and norm kernels apply
    autocast: bool = True  # compute dtype differs from the parameter dtype
    fused_loss: bool = False  # the loss runs compiled (parallel/apply.py): fused by inductor


def norm_saved_bytes(m: ModelConfig, a: ActivationSetup) -> int:
    """Bytes per element a norm saves of its input. CUDA autocast runs norms in fp32 and
    saves the fp32 cast of the input; CPU's composite RMSNorm saves an fp32 copy of the input
    and the fp32 normalised tensor; otherwise the input itself."""
    if a.device == "cuda" and a.autocast:
        return 4
    if m.norm == "rmsnorm" and a.device == "cpu":
        return 8
    return a.residual_bytes


def layer_terms(m: ModelConfig, a: ActivationSetup) -> dict[str, float]:
    """Bytes one transformer block saves for backward, per tensor group, no recompute."""
    s, b, h, t = m.seq_len, a.micro_batch, m.d_model, a.tp
    heads, kv = m.n_head, m.n_kv_head or m.n_head
    hd = h // heads
    q_dim, kv_dim, f = heads * hd, kv * hd, ffn_token_width(m)
    e = a.compute_bytes
    sb = s * b
    seq_div = t if a.sequence_parallel else 1  # tensors sharded along the sequence by SP
    in_div = t if a.sequence_parallel and not a.sp_saves_gathered else 1
    swiglu = m.mlp == "swiglu"
    attn_in_copies = 3 if a.norm_copies else 1
    mlp_in_copies = (2 if swiglu else 1) if a.norm_copies else 1
    norm_stats = 8 if m.norm == "layernorm" else 4  # fp32 mean + rstd (rstd only for RMS)
    terms = {
        "norm inputs (residual stream)": 2 * norm_saved_bytes(m, a) * sb * h / seq_div,
        "norm statistics": 2 * norm_stats * sb / seq_div,
        "attention input (norm output)": attn_in_copies * e * sb * h / in_div,
        "mlp input (norm output)": mlp_in_copies * e * sb * h / in_div,
        "attention output (wo input)": e * sb * q_dim / t,
        "mlp hidden": (4 if swiglu else 2) * e * sb * f / t,
    }
    if a.attention == "eager" and kv != heads:  # repeat_interleave expands k and v
        kv_dim = q_dim
    terms["q, k, v"] = e * sb * (q_dim + 2 * kv_dim) / t
    terms.update(attention_core_terms(m, a))
    if a.dropout > 0:  # torch's native_dropout saves a 1-byte mask
        terms["dropout masks"] = 2 * sb * h / seq_div
    return terms


def attention_core_terms(m: ModelConfig, a: ActivationSetup) -> dict[str, float]:
    """The part selective recompute removes: softmax(QK^T) and what hangs off it."""
    s, b, heads, t, e = m.seq_len, a.micro_batch, m.n_head, a.tp, a.compute_bytes
    ass = heads * s * s * b / t
    if a.attention == "fused":
        return {"softmax log-sum-exp": 4 * heads * s * b / t}
    drop = a.dropout > 0
    if a.attention == "eager":  # fp32 softmax saved; bf16 probs saved unless dropout follows
        terms = {"attention scores (fp32 softmax)": 4 * ass, "causal mask": s * s}
        terms["attention probs"] = (1 + e) * ass if drop else e * ass
        return terms
    if a.attention == "megatron":  # fused fp16 softmax, dropout mask, dropout output
        return {"attention softmax + dropout": (e + (1 + e if drop else 0)) * ass}
    raise ValueError(f"unknown attention accounting {a.attention!r}")


def linear_out_features(m: ModelConfig, name: str) -> int:
    """Output width of block Linear ``name`` (``wo`` and ``w2`` project back to d_model)."""
    hd = m.d_model // m.n_head
    return {"wq": m.n_head * hd, "wk": (m.n_kv_head or m.n_head) * hd,
            "wv": (m.n_kv_head or m.n_head) * hd, "w1": ffn_token_width(m), "w3": ffn_token_width(m)
            }.get(name, m.d_model)


def op_selective_terms(m: ModelConfig, a: ActivationSetup,
                       kept: list[str] | None = None) -> dict[str, float]:
    """What op-level selective checkpointing keeps of one block
    (parallel/activation_checkpoint.py): the block input, the outputs of every other
    matmul (``recomputed_linears`` names the rest; ``kept``: these Linears' instead), the
    fused attention kernel's output and log-sum-exp, and under sequence parallelism the two
    reduce-scatter outputs. The row-parallel matmuls (wo, w2) output the full sequence
    before their reduction."""
    s, b, h, t, e = m.seq_len, a.micro_batch, m.d_model, a.tp, a.compute_bytes
    sb, seq_div = s * b, (t if a.sequence_parallel else 1)
    recomputed = set(recomputed_linears(m))
    saved = kept if kept is not None else [n for n in block_linears(m) if n not in recomputed]
    terms = {"block input (residual stream)": a.residual_bytes * sb * h / seq_div}
    terms["saved matmul outputs (" + " ".join(saved) + ")"] = sum(
        e * sb * linear_out_features(m, n) / (1 if n in ("wo", "w2") else t) for n in saved)
    if a.attention == "fused":
        terms["attention output"] = e * sb * m.n_head * (h // m.n_head) / t
        terms.update(attention_core_terms(m, a))
    if a.sequence_parallel:
        terms["reduce-scatter outputs"] = 2 * e * sb * h / t
    return terms


def layer_bytes(m: ModelConfig, a: ActivationSetup, checkpointing: str) -> float:
    """Saved bytes of one block for one microbatch under ``checkpointing``: none,
    selective (this repository's op-level policy; Korthikanti et al.'s, the attention core
    recomputed, for the paper's ``megatron`` accounting) or full (block input only)."""
    if checkpointing == "full":
        return a.residual_bytes * m.seq_len * a.micro_batch * m.d_model / (
            a.tp if a.sequence_parallel else 1)
    if checkpointing == "selective" and a.attention != "megatron":
        return sum(op_selective_terms(m, a).values())
    if (checkpointing == "none" and a.sequence_parallel and not a.sp_saves_gathered
            and a.attention != "megatron"):
        return sum(op_selective_terms(m, a, sequence_parallel_kept(m)).values())
    terms = layer_terms(m, a)
    if checkpointing == "selective":
        for key in attention_core_terms(m, a):
            terms.pop(key, None)
    return sum(terms.values())


def backward_working_bytes(m: ModelConfig, a: ActivationSetup) -> float:
    """Transient memory while one block runs backward, beyond what is saved: the gradient of
    the widest activation (the MLP hidden, or the eager kernel's s x s probabilities) plus
    one residual-stream gradient. A stated allowance, checked against CPU measurements."""
    s, b, t = m.seq_len, a.micro_batch, a.tp
    seq_div = t if a.sequence_parallel else 1
    widest = a.compute_bytes * s * b * ffn_token_width(m) / t
    if a.attention in ("eager", "megatron"):
        widest = max(widest, a.compute_bytes * m.n_head * s * s * b / t)
    return widest + a.residual_bytes * s * b * m.d_model / seq_div


def head_and_loss(m: ModelConfig, a: ActivationSetup) -> tuple[float, float]:
    """(saved, transient) bytes of the final norm, output head and cross-entropy for one
    microbatch, as ``pretrain.model.loss.cross_entropy`` computes it.

    Small batches (one chunk: ``pretrain.model.loss.chunk_rows``) and TP (``loss_parallel``) take
    the plain path (``pretrain.model.loss.is_chunked``, the loss's own test):
    F.cross_entropy on an fp32 copy saves fp32 log-probabilities (4 n V) and its backward
    peaks at 8 n V more. Otherwise the chunked path saves the logits in the compute dtype and
    a log-sum-exp, and backward adds the logits' gradient and two fp32 chunks. A compiled
    loss (``fused_loss``) saves the logits and a log-sum-exp too, and its fused backward
    writes the logits' gradient in the compute dtype without fp32 chunks."""
    s, b, h, t = m.seq_len, a.micro_batch, m.d_model, a.tp
    n, vocab = s * b, padded_vocab_size(m) / t
    seq_div = t if a.sequence_parallel else 1
    # the head's input is gathered from the sequence shards and saved whole (no policy
    # runs outside the blocks)
    saved = norm_saved_bytes(m, a) * n * h / seq_div + a.compute_bytes * n * h
    saved += 16 * n  # int64 tokens and targets
    chunk = chunk_rows(padded_vocab_size(m))
    if a.fused_loss:
        return saved + a.compute_bytes * n * vocab + 4 * n, a.compute_bytes * n * vocab
    if not is_chunked(n, padded_vocab_size(m), vocab_sharded=t > 1):
        return saved + 4 * n * vocab, 8 * n * vocab
    return saved + a.compute_bytes * n * vocab + 4 * n, (
        a.compute_bytes * n * vocab + 8 * min(chunk, n) * vocab)


def inflight_chunks(schedule: str, pp: int, v: int, microbatches: int, pp_rank: int) -> int:
    """Chunk-microbatches whose activations pipeline rank ``pp_rank`` holds at its peak
    (a chunk is one stage of L / (pp v) layers; see the module docstring for sources)."""
    if pp == 1:
        return 1
    m = microbatches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - pp_rank)
    if schedule == "interleaved_1f1b":
        return min(m * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)
    if schedule == "zbv":
        return min(2 * m, 2 * pp)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def live_recv_buffers(schedule: str, pp: int, v: int, microbatches: int, pp_rank: int) -> int:
    """Receive buffers one stage of this rank holds at once under
    parallel/pipeline.BoundedStage, at most: the rank's microbatches in flight (one stage of
    an interleaved rank may hold most of them), plus up to ``pp`` receives the schedule posts
    before the backward that frees the oldest (measured: tests/test_parallel_layouts.py);
    never more than the microbatches of a step."""
    inflight = inflight_chunks(schedule, pp, v, microbatches, pp_rank)
    return min(microbatches, inflight + (0 if schedule == "gpipe" else pp))


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                            sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per transformer layer."""
    if recompute == "full":
        return 2 * s * b * h
    attn = 5 * a * s / (h * t) if recompute == "none" else 0.0
    if sequence_parallel:
        return s * b * h * (34 / t + attn)
    return s * b * h * (10 + 24 / t + attn)
