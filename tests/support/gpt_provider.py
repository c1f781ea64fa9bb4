"""A GPT model provider for Megatron-Core releases whose ``pretrain()`` takes one (0.17, 0.18).

Their Megatron-LM ``pretrain_gpt.py`` passes ``partial(model_provider, gpt_builder)`` from the
checkout's root (``model_provider.py``, ``gpt_builders.py``), which the megatron-core wheel does
not ship. This is the same model for what the tests run (``--transformer-impl local``): the
config from ``core_transformer_config_from_args``, the local layer spec (or the decoder block
spec with MoE), the MTP block after the last decoder layer's spec, and ``GPTModel`` with the
arguments ``gpt_builder`` passes. Only Megatron's public builders are called; the tests fill
the weights from global names anyway (``megatron_loop.with_global_init``)."""

from __future__ import annotations


def gpt_model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                       pg_collection=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    if args.transformer_impl != "local":
        raise ValueError("the tests' GPT provider builds --transformer-impl local only")
    local_layer = get_gpt_layer_local_spec(
        config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
        config.multi_latent_attention, normalization=config.normalization)
    if args.num_experts:
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    else:
        layer_spec = local_layer
    mtp_spec = None
    if args.mtp_num_layers is not None:
        # as gpt_builder: the model's last decoder layer's spec, or (a block spec whose stage
        # has no decoder layer: 'mL' alone) the layer spec
        last = local_layer
        if getattr(layer_spec, "layer_specs", None):
            last = get_gpt_decoder_layer_specs(
                config, use_transformer_engine=False, normalization=args.normalization,
                qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
        mtp_spec = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False,
                                          vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
