"""Tiny random-init causal LMs of the popular model families, built from configs
in code (transformers' AutoConfig.for_model + AutoModelForCausalLM.from_config;
nothing downloaded): hidden 32, 2 layers, 2 heads, vocab 64, no dropout.
MoE families with 4 experts, 2 per token; `router_aux=True` turns their
load-balancing loss on (output_router_logits), which the model adds to its loss."""

from __future__ import annotations

VOCAB, SEQ = 64, 16

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=SEQ, bos_token_id=1, eos_token_id=1, pad_token_id=0,
              tie_word_embeddings=False)

FAMILIES = {
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral": dict(model_type="mistral", head_dim=16, sliding_window=None),
    "gemma": dict(model_type="gemma", head_dim=16),
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=SEQ, query_pre_attn_scalar=16,
                   attn_logit_softcapping=None, final_logit_softcapping=None),
    "phi3": dict(model_type="phi3", pad_token_id=0),
    "olmo2": dict(model_type="olmo2"),
    "granite": dict(model_type="granite"),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16, decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2),
}
MOE = ("mixtral", "qwen3_moe", "olmoe")


def build(family: str, router_aux: bool = False):
    """The family's tiny model (the caller seeds)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    kw = {**COMMON, **spec}
    if family in MOE:
        kw["output_router_logits"] = bool(router_aux)
    for k in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attention_probs_dropout_prob"):
        kw.setdefault(k, 0.0)
    cfg = AutoConfig.for_model(model_type, **kw)
    return AutoModelForCausalLM.from_config(cfg)
