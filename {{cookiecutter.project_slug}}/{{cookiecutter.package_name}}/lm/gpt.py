"""A small decoder-only transformer (GPT-style): the model's math, and nothing else.

Pre-norm blocks, causal self-attention, learned positions, tied input/output
embeddings. No dropout, for the same reason as `model.py`: a rank's result must
not depend on its own random stream.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """One transformer layer: x + attention(norm(x)), then x + MLP(norm(x)). The unit that gets sharded."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=-1)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size)."""

    def __init__(self, vocab_size: int, block_size: int, n_layers: int, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}.")
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one (vocab, d_model) matrix
        # Small embeddings (GPT-2's 0.02): with the default N(0, 1) the tied head starts with huge logits.
        for table in (self.tok_emb, self.pos_emb):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))  # (B, T, d_model)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
