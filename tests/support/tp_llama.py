"""The tests' TP, 2-D and pipeline client: dormouse.bench.tp_llama (a
torchtitan-style tiny llama and torchtitan's TP plan), with the fault the
tests plant through this client's own code:

  sp_norm_local   the sequence-parallel norms keep a plain (not distributed)
                  weight and normalise their local sequence shard: the weight's
                  gradient is then this rank's positions' alone, never reduced
                  over the TP group (Megatron's sequence-parallel norm bug)
  dropout_local   the feed-forwards' KeyedDropout never told its column shard:
                  every TP rank draws the first shard's mask (dropout drawn alike on
                  the TP ranks of a sharded region, Megatron-LM #26's kind)

Recordings name `tp_llama:build_model`: the gate's reference builds the same
model through this module.
"""

from __future__ import annotations

from dormouse.bench.tp_llama import (Attention, Block, FeedForward, KeyedDropout, RMSNorm, TinyLlama,  # noqa: F401
                                     build_model, build_optimizer, pipeline_stage_module)
from dormouse.bench.tp_llama import parallelize as _parallelize


class LocalSequenceNorm:
    """The fault sp_norm_local: a sequence-parallel norm as a hand-written
    (Megatron-style) one does it when it forgets the reduction: the weight
    stays a plain tensor, the norm runs on this rank's sequence shard, and
    nothing reduces the weight's gradient over the TP group."""

    def __init__(self, mesh):
        self.mesh = mesh

    def apply(self, module):
        from torch.distributed.tensor import DTensor, Shard

        def pre(_, args):
            x = args[0]
            return (x.to_local() if isinstance(x, DTensor) else x,)

        def post(_, args, out):
            return DTensor.from_local(out, self.mesh, [Shard(1)], run_check=False)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module



def parallelize(model, mesh, *, loss_parallel: bool = True, sp_norm_local: bool = False,
                dropout_local: bool = False, mp_policy=None):
    """dormouse.bench.tp_llama.parallelize; with sp_norm_local the block norms are LocalSequenceNorm's.
    Then each feed-forward's KeyedDropout (a model built with dropout) is told its rank's column shard of
    the TP group, unless dropout_local: every TP rank then keys its mask by its LOCAL column index, so
    each draws the mask of the first shard (dropout drawn alike on the TP ranks of a sharded region,
    a dropout outside Megatron's model-parallel RNG tracker, Megatron-LM #26)."""
    norm = (lambda tp, module: LocalSequenceNorm(tp).apply(module)) if sp_norm_local else None
    _parallelize(model, mesh, loss_parallel=loss_parallel, norm=norm, mp_policy=mp_policy)
    tp = mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) and mesh.ndim > 1 else mesh
    for block in model.layers.values():
        if block.feed_forward.drop is not None and not dropout_local:
            block.feed_forward.drop.shard(tp.get_local_rank(), tp.size())
    return model
