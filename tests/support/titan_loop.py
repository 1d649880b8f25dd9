"""torchtitan itself as a client (issue 28): torchtitan's llama3 model (its
debugmodel's builder, shrunk: vocabulary 64, width 32, 4 heads, 2 layers),
parallelised by torchtitan's own `parallelize_llama` (its TP plan from the
model's sharding configs, SequenceParallel on, FSDP2 on the data dimension),
its `ParallelDims` meshes and its `CrossEntropyLoss` (vocabulary-parallel on
the TP-sharded logits, each micro-batch's token sum divided by the step's
global token count), trained by a plain loop with AdamW and recorded for the
gate. Run under torchrun (gloo):
`torchrun --standalone --nproc_per_node=W titan_loop.py --plan PLAN.json`, PLAN
a JSON list of runs (dicts, see RUN).

What the loop sets that torchtitan's trainer would not, to run on the CPU over
gloo (see docs/parallelisms.md, "torchtitan proper"):
  - the meshes' device: torchtitan takes "cuda" whenever torch finds no
    accelerator (torchtitan/tools/utils.py, get_device_info), and
    ParallelDims.build_mesh builds its meshes on it; the loop sets
    torchtitan.distributed.parallel_dims.device_type to "cpu" first;
  - the SPMD backend "partial_dtensor" (DTensor on the model-parallel axes):
    the default "spmd_types" stops in FSDP2's fully_shard on torch 2.13;
  - FSDP2's reductions forced to SUM (set_force_sum_reduction_for_comms):
    torchtitan turns FSDP2's gradient division off (the loss is already
    divided by the global token count), which FSDP2 does with PREMUL_SUM, which
    gloo lacks;
  - the attention: torchtitan's ScaledDotProductAttention module (causal) in
    place of its FlexAttention, which has no backward on the CPU (torch 2.13:
    "FlexAttention does not support backward on CPU").
torchtitan itself imports triton (its expert-parallel kernels) when the llama3
model is imported: triton must be installed, though nothing here runs it.

The mesh is (dp, tp) = (W / tp, tp); each data-parallel replica reads its own
rows of the step's global batch (its TP ranks the same rows), K micro-batches
of B rows of T tokens. The logged loss is torchtitan's: the micro-batches'
losses summed, then summed over the data-parallel ranks (dist_sum over its
"loss" mesh). Faults ("fault"):
  clean          as above
  local_tokens   each rank divides its loss by its own token count, not the
                 step's global one (the token count never summed over the
                 data-parallel ranks): with FSDP2 summing the gradients, every
                 gradient and the logged loss are the data-parallel size too large
  init_after     torchtitan's trainer's order: the model built on the meta device,
                 parallelised, then materialised on the CPU and initialised by
                 init_states() under the run's seed (each rank its own shards)
  world_tokens   the token count summed over every rank (the world mesh), TP
                 peers included, where torchtitan sums it over its batch mesh:
                 every gradient and the logged loss are 1/TP of one process's
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import plan  # tests/support: the loops' one main

RUN = {"out": None, "fault": "clean", "seed": 0, "steps": 2, "tp": 2, "micro": 2, "rows": 2, "T": 8}
VOCAB, DIM, HEADS, LAYERS = 64, 32, 4, 2
BACKEND = "partial_dtensor"


def model_config():
    """torchtitan's llama3 debugmodel (torchtitan/models/llama3/__init__.py: _debugmodel), shrunk, with
    the SDPA attention module and torchtitan's sharding configs (SequenceParallel on) filled in."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                          _output_linear_init)
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex"))
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(cfg, enable_sp=True)
    return cfg


def build_model(seed: int = 0, **_):
    """The unparallelised model, initialised by torchtitan's own init_states under `seed`."""
    torch.manual_seed(seed)
    model = model_config().build()
    model.init_states()
    return model


def build_optimizer(model, lr: float = 1e-2, **_):
    # foreach=False: the same per-tensor arithmetic on DTensor shards as on full tensors
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=False)


def batch_rows(seed: int, step: int, n: int, T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randint(0, VOCAB, (n, T), generator=g)


def parallel_dims(world: int, tp: int):
    """torchtitan's ParallelDims (dp_shard x tp) and its meshes, built on the CPU."""
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.models.llama3  # noqa: F401  its imports register torch's "fake" backend (size-1 mesh axes)
    from torchtitan.distributed.utils import set_spmd_backend

    titan_dims.device_type = "cpu"  # torchtitan's default is "cuda" when torch finds no accelerator
    set_spmd_backend(BACKEND)
    pd = titan_dims.ParallelDims(dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=1, world_size=world,
                                 spmd_backend=BACKEND)
    pd.build_mesh()
    return pd


def parallelize(model, pd, out: str) -> None:
    """torchtitan's parallelize_llama (TP from the sharding configs, then FSDP2 on its fsdp mesh), float32."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3.parallelize import parallelize_llama

    parallelize_llama(model, parallel_dims=pd,
                      training=TrainingConfig(mixed_precision_param="float32"),
                      parallelism=ParallelismConfig(tensor_parallel_degree=pd.tp, data_parallel_shard_degree=pd.dp_shard,
                                                    spmd_backend=BACKEND),
                      compile_config=CompileConfig(), ac_config=None, dump_folder=out)
    for m in model.modules():  # torchtitan's gradient-division-off uses PREMUL_SUM, which gloo lacks: plain SUM
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def run(cfg: dict) -> None:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.utils import dist_sum, dist_sum_tensor

    from dormouse.gate import Recorder, RecordingSpec

    cfg = {**RUN, **cfg}
    world = dist.get_world_size()
    tp = cfg["tp"]
    pd = parallel_dims(world, tp)
    dp = pd.dp_shard
    dp_rank = pd.get_mesh("batch").get_local_rank() if pd.dp_enabled else 0
    if cfg["fault"] == "init_after":
        with torch.device("meta"):
            model = model_config().build()
        parallelize(model, pd, cfg["out"])
        model.to_empty(device="cpu")
        torch.manual_seed(cfg["seed"])
        with torch.no_grad():
            model.init_states()
    else:
        model = build_model(seed=cfg["seed"])
        parallelize(model, pd, cfg["out"])
    opt = build_optimizer(model)
    rec = Recorder(cfg["out"], model, RecordingSpec(build_model="titan_loop:build_model",
                                                    build_optimizer="titan_loop:build_optimizer", objective="causal_lm",
                                                    build_kwargs={"seed": cfg["seed"]}))
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    K, B, T = cfg["micro"], cfg["rows"], cfg["T"]
    for step in range(cfg["steps"]):
        rows = batch_rows(cfg["seed"], step, dp * K * B, T)
        mine = rows[dp_rank * K * B:(dp_rank + 1) * K * B]
        local_tokens = torch.tensor(K * B * (T - 1), dtype=torch.int64)
        if cfg["fault"] == "world_tokens":
            tokens = dist_sum_tensor(local_tokens, pd.world_mesh)
        elif pd.dp_enabled and cfg["fault"] != "local_tokens":  # torchtitan's train_step: summed over its batch mesh
            tokens = dist_sum_tensor(local_tokens, pd.get_mesh("batch"))
        else:
            tokens = local_tokens
        total = torch.zeros(())
        for m in range(K):
            ids = mine[m * B:(m + 1) * B]
            logits = model(ids)
            loss, _ = loss_fn(logits[:, :-1], ids[:, 1:], tokens)
            loss.backward()
            total += loss.detach()
        logged = dist_sum(total, pd.get_optional_mesh("loss")) if pd.dp_cp_enabled else float(total)
        rec.step(loss=torch.tensor(logged), optimizer=opt)
        opt.step()
        opt.zero_grad()
    rec.close()


if __name__ == "__main__":
    sys.exit(plan.main(run))
