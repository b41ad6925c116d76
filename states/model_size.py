"""A model's size from its ArchitectureSection: the MLP's width, the parameters that multiply, and PaLM's
model FLOPs per token. Arithmetic only, so the engine's model, the exports, the config checks, the thread
count and `rewind bench mfu` all read one rule (architecture.d_ff = 0 means 4 * d_model)."""

from __future__ import annotations

from rewind.states.config import ArchitectureSection


def mlp_width(arch: ArchitectureSection) -> int:
    """The MLP's hidden width: architecture.d_ff, or 4 * d_model where it is 0."""
    return arch.d_ff or 4 * arch.d_model


def head_width(arch: ArchitectureSection) -> int:
    """Each attention head's width: architecture.head_dim, or d_model / num_heads where it is 0."""
    return arch.head_dim or arch.d_model // arch.num_heads


def kv_heads(arch: ArchitectureSection) -> int:
    """The key/value heads: architecture.num_kv_heads, or num_heads (one per query head) where it is 0."""
    return arch.num_kv_heads or arch.num_heads


def qkv_rows(arch: ArchitectureSection) -> int:
    """The fused q, k, v projection's output rows: num_heads query heads and twice kv_heads key/value heads."""
    return (arch.num_heads + 2 * kv_heads(arch)) * head_width(arch)


def matmul_parameters(arch: ArchitectureSection) -> int:
    """The weights that multiply a token's activations in `arch`'s model: each block's attention (q, k, v:
    d x qkv_rows, and the output projection: num_heads * head_width x d; 4 d^2 with the defaults) and MLP
    (2 d d_ff, 3 with swiglu's gate), and the output head (also with tied embeddings: it multiplies); not
    the embedding (a lookup), the biases nor the norms' gains."""
    d = arch.d_model
    attention = d * qkv_rows(arch) + arch.num_heads * head_width(arch) * d
    mlp = (3 if arch.mlp == "swiglu" else 2) * d * mlp_width(arch)
    return arch.num_layers * (attention + mlp) + d * arch.vocab_size


def flops_per_token(arch: ArchitectureSection, num_matmul_parameters: int) -> int:
    """PaLM's model FLOPs per token (appendix B): 6 N + 12 L a T, N the parameters that multiply, L the
    layers, a = num_heads * head_width (d_model with the defaults), T = block_size: 6 N for the forward and
    backward matmuls, 12 L a T for attention's scores and weighted sums (grouped-query attention shares keys
    and values, not these products), counted whole although the causal mask makes half of them zeros."""
    width = arch.num_heads * head_width(arch)
    return 6 * num_matmul_parameters + 12 * arch.num_layers * width * arch.block_size
