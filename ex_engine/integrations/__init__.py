"""Adapters that make other libraries' models run on ex_engine's factors.

``ex_engine.integrations.transformers``: Hugging Face transformers MoE models (Qwen3-MoE, OLMoE,
Mixtral): ``patch_moe(model)`` routes their router and routed experts through ``topk_softmax``
and ``moe_fused_gemm`` on views of the model's own weights, ``handle.undo()`` restores them.
Importing this package imports neither torch nor transformers.
"""
