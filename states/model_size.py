"""A model's size from its ArchitectureSection: the MLP's width, the parameters that multiply, and PaLM's
model FLOPs per token. Arithmetic only, so the engine's model, the exports, the config checks, the thread
count and `rewind bench mfu` all read one rule (architecture.d_ff = 0 means 4 * d_model)."""

from __future__ import annotations

from rewind.states.config import ArchitectureSection


def mlp_width(arch: ArchitectureSection) -> int:
    """The MLP's hidden width: architecture.d_ff, or 4 * d_model where it is 0."""
    return arch.d_ff or 4 * arch.d_model


def matmul_parameters(arch: ArchitectureSection) -> int:
    """The weights that multiply a token's activations in `arch`'s model: each block's attention (q, k, v
    and the output projection: 4 d^2) and MLP (2 d d_ff, 3 with swiglu's gate), and the output head; not
    the embedding (a lookup) nor the norms' gains."""
    d = arch.d_model
    mlp = (3 if arch.mlp == "swiglu" else 2) * d * mlp_width(arch)
    return arch.num_layers * (4 * d * d + mlp) + d * arch.vocab_size


def flops_per_token(arch: ArchitectureSection, num_matmul_parameters: int) -> int:
    """PaLM's model FLOPs per token (appendix B): 6 N + 12 L d T, N the parameters that multiply, L the
    layers, d = d_model, T = block_size: 6 N for the forward and backward matmuls, 12 L d T for attention's
    scores and weighted sums, counted whole although the causal mask makes half of them zeros."""
    return 6 * num_matmul_parameters + 12 * arch.num_layers * arch.d_model * arch.block_size
