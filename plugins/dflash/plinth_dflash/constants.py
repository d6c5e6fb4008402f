"""GGUF names of the ``dflash`` architecture (llama.cpp's spelling; gguf-py 0.19.0 lacks them).

Keys are written ``{ARCH}.{name}``; tensors use llama.cpp's short names. The
LiLiCorr names are plinth's own (llama.cpp's were not published, see README.md).
"""

ARCH = "dflash"

# ---------------------------------------------------------------- metadata keys (after the arch prefix)
KEY_TARGET_LAYERS = "target_layers"  # i32/u32 array: tap ids after the +1 rule (required)
KEY_BLOCK_SIZE = "block_size"  # u32, default 16
KEY_TARGET_HIDDEN = "target_hidden_size"  # u32, written by the early converter, informational
KEY_MASK_TOKEN = "mask_token_id"  # early converter; the runtime key is tokenizer.ggml.mask_token_id
KEY_MASK_TOKEN_TOK = "tokenizer.ggml.mask_token_id"
KEY_EPS = "attention.layer_norm_rms_epsilon"
KEY_SWA = "attention.sliding_window"
KEY_SWA_PATTERN = "attention.sliding_window_pattern"  # bool array per layer
KEY_CAUSAL = "attention.causal"  # bool
KEY_CAUSAL_LAYERS = "attention.causal_layers"  # plinth extension: bool array per layer (see README)
KEY_DECODER_ARCH = "decoder_arch"  # "laguna" implies causal
KEY_LOGIT_SCALE = "logit_scale"
KEY_SOFTCAP = "final_logit_softcapping"
KEY_TIED = "tie_word_embeddings"  # bool: the head is the draft's own token_embd
KEY_CONV_KERNEL = "conv_kernel_size"
KEY_CONV_GROUP = "conv_group_size"
KEY_SEL_RANK = "selector_rank"
KEY_SEL_TOP_K = "selector_top_k"
# optional transforms llama.cpp's dflash.cpp applies (issue 40)
KEY_EMBD_SCALE = "embedding_scale"  # f32: the block's token embeddings times it (0 / absent: none)
KEY_ATTN_SCALE = "attention.scale"  # f32: the score scale (0 / absent: 1 / sqrt(head_dim))
KEY_VALUE_SCALE = "attention.value_scale"  # f32: the attention output (after attn_output) times it
KEY_HIDDEN_ACT = "hidden_activation"  # str: "silu" (default), "gelu" / "gelu_pytorch_tanh" (tanh GELU)
# Gemma 4 draft layers (the gemma4 target's key names; plinth extensions for a dflash draft, see README)
SWA_GEOMETRY_KEYS = ("attention.key_length_swa", "attention.value_length_swa", "rope.freq_base_swa",
                     "rope.dimension_count_swa")
KEY_VALUE_NORM = "attention.value_norm"  # bool: V through a weightless RMSNorm on every layer (Gemma 4)

# LiLiCorr head geometry (plinth names, [inferred])
LILI_PREFIX = "lilicorr."
KEY_LILI_TOP_K = "lilicorr.candidate_top_k"
KEY_LILI_HIDDEN = "lilicorr.hidden_size"
KEY_LILI_LAYERS = "lilicorr.block_count"
KEY_LILI_HEADS = "lilicorr.head_count"
KEY_LILI_MLP_RATIO = "lilicorr.mlp_ratio"
KEY_LILI_FACTOR = "lilicorr.factor_dim"
KEY_LILI_VEC_EPS = "lilicorr.vector_eps"
KEY_LILI_LAMBDA = "lilicorr.logit_scale"

# ---------------------------------------------------------------- tensors
T_FC = "fc.weight"
T_FC_SCALE = "fc.scale"
T_FC_INPUT_SCALE = "fc.input_scale"
T_ENC_NORM = "enc.output_norm.weight"
T_OUTPUT_NORM = "output_norm.weight"
T_TOKEN_EMBD = "token_embd.weight"
T_OUTPUT = "output.weight"
T_D2T = "d2t"
T_MARKOV_W1 = "markov_w1.weight"  # DSpark marker (not served by this plugin)
T_SEL_HIDDEN = "selector_hidden.weight"
T_SEL_PRED = "selector_predecessor.weight"
T_SEL_SUCC = "selector_successor.weight"
T_ROPE_FREQS = "rope_freqs.weight"  # [n_rot / 2] per-pair frequency divisors (optional)
#: optional per-layer tensors (``blk.N.`` + name): RMSNorm weights after the attention and the FFN (before
#: their residual adds), and a one-element multiplier of the layer's output
T_POST_ATTN_NORM = "post_attention_norm.weight"
T_POST_FFN_NORM = "post_ffw_norm.weight"
T_LAYER_OUT_SCALE = "layer_output_scale.weight"

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
#: projections that may carry a per-tensor ``.scale``
SCALED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_conv_proj",
          "ffn_conv_proj")

VARIANTS = ("dflash", "dflash2", "lilicorr")
