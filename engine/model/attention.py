"""A block's self-attention: the fused q, k, v projection, RoPE, scaled dot-product attention, the output
projection; and the architecture options of today's open models (transformers' Llama, Qwen2, Qwen3).

With every option at its default (num_kv_heads = num_heads, head_dim = d_model / num_heads, no bias, no
q/k norm) it computes exactly what rewind's attention always has, with the same parameters (`qkv`, `proj`).
`qkv`'s rows are [q; k; v]: num_heads query heads, then num_kv_heads key heads and as many value heads,
each head_dim wide. Grouped-query attention (num_kv_heads < num_heads) gives each key/value head to
num_heads / num_kv_heads consecutive query heads, as transformers' `repeat_kv` does; a cache keeps the
key/value heads alone. `qk_norm` (Qwen3) normalises each head's q and k over head_dim (`q_norm`, `k_norm`,
shared by the heads) after the projection and before RoPE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rewind.engine.model.attention_inputs import KeysValues
from rewind.states.config import ArchitectureSection
from rewind.states.model_size import head_width, kv_heads, qkv_rows


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the last dim of x (B, H, T, D), halves convention (GPT-NeoX)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ArchitectureSection):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = arch.num_heads, kv_heads(arch), head_width(arch)
        # The path rewind always had: one (B, T, 3, H, D) view of qkv's output.
        self.plain = self.num_kv_heads == self.num_heads and self.head_size * self.num_heads == arch.d_model
        self.qkv = nn.Linear(arch.d_model, qkv_rows(arch), bias=arch.qkv_bias)
        self.proj = nn.Linear(self.num_heads * self.head_size, arch.d_model, bias=False)
        if arch.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_size, eps=arch.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_size, eps=arch.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal: bool = True,
        mask: torch.Tensor | None = None,
        kv: KeysValues | None = None,
    ) -> torch.Tensor:
        """`mask` (B, 1, T, S), added to the scores (0 or -inf), in place of `causal`; `kv` stores the new
        keys and values in a cache and gives back every key and value the queries may see."""
        batch, length = x.shape[:2]
        heads, kv_count, size = self.num_heads, self.num_kv_heads, self.head_size
        if self.plain:
            qkv = self.qkv(x).view(batch, length, 3, heads, size).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)  # each (B, H, T, D)
        else:
            q, k, v = self.qkv(x).split([heads * size, kv_count * size, kv_count * size], dim=-1)
            q = q.view(batch, length, heads, size).transpose(1, 2)
            k = k.view(batch, length, kv_count, size).transpose(1, 2)
            v = v.view(batch, length, kv_count, size).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if kv is not None:
            k, v = kv(k, v)
        if kv_count != heads:
            k = k.repeat_interleave(heads // kv_count, dim=1)
            v = v.repeat_interleave(heads // kv_count, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        return self.proj(y.transpose(1, 2).reshape(batch, length, heads * size))
