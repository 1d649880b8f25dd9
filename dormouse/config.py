"""Configuration: what network to build (ModelConfig), how to train it
(TrainConfig), and the two together with where they came from (RunConfig).

Plain dataclasses with a comment on every field and defaults that run. They
round-trip through JSON (`to_dict` / `from_dict`), so every artifact can
record exactly the configuration that made it. `validate()` raises one
`ConfigError` naming the field, its value and what is allowed.

Presets are named ModelConfig instances (`PRESETS["tiny"]`, `PRESETS["small"]`).
`build_run` is the one way a run is composed from a file or a preset, flags
and `--set` pairs (the command line's `dormouse train` uses it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dormouse.errors import ConfigError

# The allowed values of the string-valued options, in one place so the
# validation messages and the command-line help say the same thing.
OPTIMIZERS = ("mix", "adamw")
NS_KINDS = ("quintic", "polar_express")
NS_DTYPES = ("bfloat16", "float32")
NS_KERNELS = ("auto", "native", "fp32")
STATE_DTYPES = ("float32", "bfloat16")
MUON_VARIANTS = ("muon", "normuon")
MUON_SHAPE_RULES = ("original", "match_rms_adamw")
SCHEDULES = ("constant", "cosine")
DIST_REDUCES = ("fp32", "bf16", "exact")
DIST_SHARDS = ("none", "fsdp")
DATA_ORDERS = ("sequential", "shuffle")


@dataclass
class ModelConfig:
    """The network. Every optional arm is switched off by a size of 0 and then
    owns no parameters at all."""

    vocab: int = 256  # tokens are bytes: 256 symbols
    d_model: int = 64  # residual stream width
    n_heads: int = 4  # causal self-attention heads
    head_dim: int = 16  # width of one head; n_heads * head_dim must equal d_model
    max_seq_len: int = 64  # longest window the model accepts (RoPE table length)
    max_iter: int = 2  # the one shared block is applied this many times (recurrent depth)
    rank: int = 8  # rank of the per-iteration low-rank adapters on attention (0 = none)
    d_ffn: int = 128  # hidden width of one expert
    n_experts: int = 4  # routed experts in the mixture-of-experts FFN (0 = no MoE)
    moe_topk: int = 2  # experts each token is routed to
    moe_capacity: float = 0.0  # 0 = dropless; > 0 = capacity factor, overflow dropped
    moe_bias_rate: float = 1e-3  # step of the loss-free load-balancing router bias (0 = off)
    shared_rank: int = 16  # rank of the always-on shared expert (0 = none)
    engram_rows: int = 64  # rows of each Engram hash table (0 = no Engram memory)
    engram_dim: int = 8  # width of one Engram table row
    engram_max_n: int = 3  # Engram looks up n-grams of orders 2..engram_max_n
    engram_heads: int = 2  # hash functions (tables) per n-gram order
    rope_base: float = 10000.0  # RoPE frequency base
    init_std: float = 0.02  # standard deviation of the initial weights
    bf16: bool = False  # train in bfloat16: the run casts the model's parameters

    @property
    def moe_on(self) -> bool:
        return self.n_experts > 0

    @property
    def engram_on(self) -> bool:
        return self.engram_rows > 0

    def validate(self) -> "ModelConfig":
        _check_types(self)
        for name in ("vocab", "d_model", "n_heads", "head_dim", "max_seq_len", "max_iter"):
            _positive(self, name)
        for name in ("rank", "d_ffn", "n_experts", "moe_topk", "shared_rank",
                     "engram_rows", "engram_dim", "engram_heads"):
            _non_negative(self, name)
        if self.vocab < 256:
            raise ConfigError(
                f"model.vocab = {self.vocab}: tokens are bytes, so it must be at least 256"
            )
        if self.n_heads * self.head_dim != self.d_model:
            raise ConfigError(
                f"model.n_heads * model.head_dim = {self.n_heads} * {self.head_dim} = "
                f"{self.n_heads * self.head_dim}, but model.d_model = {self.d_model}: "
                "they must be equal"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model.head_dim = {self.head_dim} is odd: RoPE rotates pairs of "
                "channels, so it must be even"
            )
        if self.moe_on:
            if self.d_ffn <= 0:
                raise ConfigError(
                    f"model.d_ffn = {self.d_ffn} with model.n_experts = {self.n_experts}: "
                    "experts need d_ffn > 0 (or set n_experts = 0 to switch MoE off)"
                )
            if not 1 <= self.moe_topk <= self.n_experts:
                raise ConfigError(
                    f"model.moe_topk = {self.moe_topk} must be between 1 and "
                    f"model.n_experts = {self.n_experts}"
                )
        if not (math.isfinite(self.moe_capacity) and self.moe_capacity >= 0):
            raise ConfigError(
                f"model.moe_capacity = {self.moe_capacity}: use 0 (dropless) or a "
                "positive capacity factor"
            )
        if not (math.isfinite(self.moe_bias_rate) and self.moe_bias_rate >= 0):
            raise ConfigError(f"model.moe_bias_rate = {self.moe_bias_rate} must be >= 0")
        if (self.engram_rows > 0) != (self.engram_dim > 0):
            raise ConfigError(
                f"model.engram_rows = {self.engram_rows}, model.engram_dim = "
                f"{self.engram_dim}: set both > 0 for Engram memory, or both to 0"
            )
        if self.engram_on and (self.engram_max_n < 2 or self.engram_heads < 1):
            raise ConfigError(
                f"model.engram_max_n = {self.engram_max_n} must be >= 2 and "
                f"model.engram_heads = {self.engram_heads} >= 1 when Engram is on"
            )
        if not (math.isfinite(self.rope_base) and self.rope_base > 0):
            raise ConfigError(f"model.rope_base = {self.rope_base} must be a finite number > 0")
        if not self.init_std > 0:
            raise ConfigError(f"model.init_std = {self.init_std} must be > 0")
        return self


@dataclass
class TrainConfig:
    """How one run trains: data, optimizer, schedule, logging, checkpoints and,
    for a fleet, how the ranks split and synchronise."""

    seed: int = 0  # seeds model initialisation when the run builds the model
    steps: int = 200  # optimizer steps
    batch: int = 4  # windows per step (per rank in a fleet without dist_profile)
    micro_batch: int = 0  # windows per forward/backward slice, dividing each rank's batch (0 = all; see FleetPlan)
    seq_len: int = 64  # tokens per window; at most model.max_seq_len
    lr: float = 3e-3  # peak learning rate, shared by the Muon and AdamW groups
    schedule: str = "constant"  # learning-rate shape after warm-up: constant | cosine
    warmup: int = 0  # linear warm-up steps (0 = start at lr)
    min_lr_frac: float = 0.1  # cosine schedule ends at lr * min_lr_frac
    wd: float = 0.0  # decoupled weight decay, both groups
    grad_clip: float = 0.0  # clip the global gradient norm to this (0 = off)
    opt: str = "mix"  # mix = Muon for hidden matrices + AdamW for the rest; adamw = AdamW for all
    ns_steps: int = 5  # Newton-Schulz iterations per Muon step
    ns_kind: str = "quintic"  # Newton-Schulz coefficients: quintic | polar_express
    ns_dtype: str = "bfloat16"  # dtype Newton-Schulz runs in (torch's Muon uses bfloat16)
    ns_kernel: str = "auto"  # bfloat16 Newton-Schulz: native = torch's bf16 matmul (bitwise torch.optim.Muon); fp32 = bf16 values and rounding through fp32 matmuls (no cliff on CPUs without native bf16); auto = native where bf16 matmuls are native, else fp32 (see newton_schulz.py)
    muon_momentum: float = 0.95  # Muon momentum
    muon_nesterov: bool = True  # Nesterov momentum for Muon
    muon_variant: str = "muon"  # muon | normuon (per-neuron second-moment normalisation)
    muon_sf: str = "match_rms_adamw"  # Muon lr shape rule: original | match_rms_adamw
    muon_colrow_3d: bool = True  # stacked 3D weights: True = one matrix per slice, False = flattened
    muon_state_dtype: str = "float32"  # dtype of Muon's momentum buffer
    adam_beta1: float = 0.9  # AdamW first-moment decay
    adam_beta2: float = 0.95  # AdamW second-moment decay
    adam_eps: float = 1e-8  # AdamW denominator epsilon
    log_every: int = 10  # one log line every this many steps (and at the last step)
    eval_every: int = 0  # evaluate on the held-out tail every this many steps (0 = never)
    eval_frac: float = 0.0  # fraction of the corpus held out at its end for eval
    ckpt_every: int = 0  # checkpoint every this many steps and at the end (0 = never)
    ckpt_name: str = "dormouse"  # checkpoint and metrics file stem inside out_dir
    out_dir: str = "artifacts/run"  # where checkpoints and metrics go
    data: str = ""  # corpus file of bytes ("" = the built-in corpus, written into out_dir)
    # Which span step k reads (train/data.py): sequential = span (k mod n) from the corpus's start, the
    # rule a hand-written reference re-derives (rank r's slice at rank_byte_offset within it); shuffle =
    # a seeded permutation per epoch (seed, epoch), `dormouse train`'s default. Both read the same
    # bytes for one process and for every fleet.
    data_order: str = "sequential"
    resume: bool = False  # continue from out_dir/<ckpt_name> if that checkpoint exists
    resume_from: str = ""  # continue from this checkpoint (.pt file or .dcp dir), any topology
    stop_at: int = 0  # end this launch after step stop_at, checkpointing there (0 = run to steps); the schedule still spans steps
    dist: bool = False  # this run is one rank of a torch.distributed fleet
    dist_profile: str = ""  # the fleet's per-rank shapes, e.g. "4,2" or "4x32,2x64" ("" = batch each; see FleetPlan)
    dist_reduce: str = "fp32"  # fp32 | bf16 ring all-reduce | exact: a fixed tree over slices
    dist_shard: str = "none"  # none = replicated parameters; fsdp = FSDP2 fully_shard
    dist_bucket_mb: float = 4.0  # size of one flattened gradient all-reduce bucket (MiB)

    def validate(self) -> "TrainConfig":
        _check_types(self)
        for name in ("steps", "batch", "seq_len", "ns_steps", "log_every"):
            _positive(self, name)
        for name in ("warmup", "eval_every", "ckpt_every", "seed", "stop_at", "micro_batch"):
            _non_negative(self, name)
        for name, allowed in (
            ("opt", OPTIMIZERS), ("ns_kind", NS_KINDS), ("ns_dtype", NS_DTYPES),
            ("ns_kernel", NS_KERNELS), ("muon_variant", MUON_VARIANTS), ("muon_sf", MUON_SHAPE_RULES),
            ("muon_state_dtype", STATE_DTYPES), ("schedule", SCHEDULES),
            ("dist_reduce", DIST_REDUCES), ("dist_shard", DIST_SHARDS),
            ("data_order", DATA_ORDERS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(
                    f"train.{name} = {value!r} is not one of {', '.join(map(repr, allowed))}"
                )
        for name in ("lr", "wd", "grad_clip", "adam_eps", "dist_bucket_mb"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"train.{name} = {value} must be a finite number >= 0")
        if not self.lr > 0:
            raise ConfigError(f"train.lr = {self.lr} must be > 0")
        for name in ("adam_beta1", "adam_beta2", "muon_momentum", "min_lr_frac"):
            value = getattr(self, name)
            if not 0 <= value < 1 and not (name == "min_lr_frac" and value == 1):
                raise ConfigError(f"train.{name} = {value} must lie in [0, 1)")
        if not 0 <= self.eval_frac < 1:
            raise ConfigError(f"train.eval_frac = {self.eval_frac} must lie in [0, 1)")
        if self.eval_every and not self.eval_frac:
            raise ConfigError(
                f"train.eval_every = {self.eval_every} needs a held-out tail: "
                "set train.eval_frac > 0 (e.g. 0.1)"
            )
        if not self.ckpt_name or "/" in self.ckpt_name:
            raise ConfigError(
                f"train.ckpt_name = {self.ckpt_name!r} must be a plain file stem"
            )
        return self


def _accept_old_names(cls, aliases: dict[str, str]):
    """`cls(old=...)`, `dataclasses.replace(x, old=...)` and `x.old` read and
    set the field's new name (a name is never written under its old one). The
    old name, when given, wins: replace() passes every field's current value."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        for old, new in aliases.items():
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
    cls.__init__ = __init__
    for old, new in aliases.items():
        setattr(cls, old, property(lambda self, n=new: getattr(self, n),
                                   lambda self, v, n=new: setattr(self, n, v), doc=f"The old name of {new}."))


# The old name of dist_profile (before "capacity" meant only the MoE's capacity factor).
_accept_old_names(TrainConfig, {"dist_capacity": "dist_profile"})


@dataclass
class RunConfig:
    """One run: the model, the training, and a free-text note of who made it."""

    source: str = "dormouse"  # who made this run (a preset name, "dist-gate", "cli", ...)
    model: ModelConfig = field(default_factory=ModelConfig)  # the network
    train: TrainConfig = field(default_factory=TrainConfig)  # how to train it

    def validate(self) -> "RunConfig":
        self.model.validate()
        self.train.validate()
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len = {self.train.seq_len} exceeds model.max_seq_len = "
                f"{self.model.max_seq_len}: shorten the window or build a longer model"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        return cls(
            source=d.get("source", "dormouse"),
            model=_from_dict(ModelConfig, d.get("model", {}), "model"),
            train=_from_dict(TrainConfig, d.get("train", {}), "train"),
        )

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls.from_dict(json.loads(text))


# The gate's TINY model: d=64, 4 experts, adapters of rank 8, 2 iterations,
# dropless MoE (a capacity-dropping MoE is a different network in a fleet).
TINY = ModelConfig()

# A size where one CPU core is busy with matrix work rather than overhead.
SMALL = ModelConfig(
    d_model=256, n_heads=4, head_dim=64, max_seq_len=256, max_iter=4, rank=16,
    d_ffn=512, n_experts=4, moe_topk=2, shared_rank=64,
    engram_rows=4096, engram_dim=32,
)

PRESETS: dict[str, ModelConfig] = {"tiny": TINY, "small": SMALL}


def preset(name: str) -> ModelConfig:
    """A fresh copy of a named preset (so callers may change it freely)."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])


# ---------------------------------------------------------------- composing a run


def build_run(*, file: str = "", preset_name: str | None = None, flags: dict[str, Any] | None = None,
              sets: list[str] | tuple[str, ...] = (), defaults: TrainConfig | None = None,
              source: str = "cli") -> RunConfig:
    """THE composition of a run, validated: the network and recipe from a
    RunConfig JSON `file` or a preset (`preset_name`, default tiny, with
    `defaults` as its TrainConfig), then `flags` (TrainConfig fields by name),
    then `sets` ("model.FIELD=VALUE", "train.FIELD=VALUE" or a bare train
    FIELD=VALUE, typed by the field): the last word wins."""
    if file and preset_name:
        raise ConfigError("--config and --preset both name a model: give one of them")
    if file:
        run = read_config(file)
    else:
        name = preset_name or "tiny"
        run = RunConfig(source=f"{source}:{name}", model=preset(name), train=defaults or TrainConfig())
    model_set, train_set = parse_sets(sets)
    train_fields = {**(flags or {}), **train_set}
    try:
        model = dataclasses.replace(run.model, **model_set)
        train = dataclasses.replace(run.train, **train_fields)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    return RunConfig(source=run.source, model=model, train=train).validate()


def read_config(path: str) -> RunConfig:
    """A RunConfig from a JSON file, or one clear ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path!r} is not a file: give a RunConfig JSON such as a run's run.json")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--config {path!r} is not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--config {path!r} holds a JSON {type(d).__name__}, not an object with model/train")
    try:
        return RunConfig.from_dict(d)
    except TypeError as e:  # a section that is not an object
        raise ConfigError(f"--config {path!r}: {e}") from None


def parse_sets(pairs) -> tuple[dict, dict]:
    """--set pairs as ({model field: value}, {train field: value}), each value
    typed by its field."""
    sections = {"model": ModelConfig, "train": TrainConfig}
    out: dict[str, dict] = {"model": {}, "train": {}}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        section, dot, fname = name.partition(".")
        if not dot:
            section, fname = "train", name
        fname = ALIASES.get(fname, fname) if section == "train" else fname  # train.dist_capacity: old name
        cls = sections.get(section)
        by_name = {f.name: f for f in fields(cls)} if cls else {}
        if not sep or fname not in by_name:
            known = ", ".join(sorted(by_name)) if cls else "model.FIELD or train.FIELD"
            raise ConfigError(
                f"--set {pair!r}: use field=value (a TrainConfig field) or model.field=value / "
                f"train.field=value; {section} fields: {known}")
        out[section][fname] = _parse_value(by_name[fname], value, pair)
    return out["model"], out["train"]


def _parse_value(f: dataclasses.Field, text: str, pair: str):
    kind = f.type
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"--set {pair!r}: expected a {kind} for {f.name}") from None
# Old JSON keys still read, under their new names (run.json files written before the rename).
ALIASES = {"dist_capacity": "dist_profile"}


def _from_dict(cls, d: dict[str, Any], where: str):
    known = {f.name for f in fields(cls)}
    d = {(ALIASES[k] if k in ALIASES and ALIASES[k] in known and ALIASES[k] not in d else k): v for k, v in d.items()}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(
            f"{where} has unknown field(s) {', '.join(unknown)}; known fields: "
            f"{', '.join(sorted(known))}"
        )
    return cls(**d)


def _check_types(cfg) -> None:
    """Reject a value of the wrong type (say "two" for an int) by name."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        want = {"int": int, "float": (int, float), "bool": bool, "str": str}[f.type]
        ok = isinstance(value, want) and not (f.type in ("int", "float") and isinstance(value, bool))
        if not ok:
            section = "model" if isinstance(cfg, ModelConfig) else "train"
            raise ConfigError(
                f"{section}.{f.name} = {value!r} has type {type(value).__name__}; "
                f"it must be {f.type}"
            )


def _positive(cfg, name: str) -> None:
    if getattr(cfg, name) <= 0:
        section = "model" if isinstance(cfg, ModelConfig) else "train"
        raise ConfigError(f"{section}.{name} = {getattr(cfg, name)} must be > 0")


def _non_negative(cfg, name: str) -> None:
    if getattr(cfg, name) < 0:
        section = "model" if isinstance(cfg, ModelConfig) else "train"
        raise ConfigError(f"{section}.{name} = {getattr(cfg, name)} must be >= 0")
