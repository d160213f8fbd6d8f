"""A LLaMA-style decoder: RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU MLP.

Only the model's maths lives here; how it is split into pipeline chunks is runtime/stages.py. Layers sit in
a `ModuleDict` keyed by their global index ("0".."L-1"), so a chunk's parameter names are the full model's
names. A chunk is the full model with the parts it does not hold set to None (`tok_embeddings`, `norm`,
`output`) or deleted (`layers`); `forward` takes tokens when the chunk embeds and a hidden state otherwise.

Initialisation is per submodule from a generator seeded by (seed, name), on the CPU, so a parameter's
initial value does not depend on how the model was split, on which device it lives, or on what else was
built first: a pipeline's chunks start from exactly the single-process model's weights.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    """Hidden size h."""
    n_layers: int
    n_heads: int
    n_kv_heads: int
    """Key/value heads (GQA); must divide n_heads."""
    ffn_hidden: int
    """SwiGLU inner size f."""
    vocab: int
    seq_len: int
    """Longest sequence the rotary tables cover."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def from_scenario(cls, model) -> ModelArgs:
        """From a scenario's `[model]` table (sim.config.ModelConfig)."""
        return cls(model.hidden, model.layers, model.heads, model.kv_heads, model.ffn_hidden, model.vocab,
                   model.seq_len)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (seq_len, head_dim // 2)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1), (x2, x3), ... of each head: x (B, T, nh, hd), cos/sin (T, hd/2)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, T, nh, hd/2)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class AttentionCore(nn.Module):
    """Causal softmax(QK^T / sqrt(d)) V, GQA's K and V shared by n_heads / n_kv_heads query heads each.

    Its own module (no parameters, so no names change) because it is the unit Megatron's selective
    recomputation recomputes (Korthikanti et al. 2022, sec. 4.2: the attention core, not the QKV and output
    projections); runtime/memory.py checkpoints exactly this call."""

    def __init__(self, gqa: bool):
        super().__init__()
        self.gqa = gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hd), k and v (B, nkv, T, hd) -> (B, nh, T, hd)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.core = AttentionCore(gqa=args.n_kv_heads != args.n_heads)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, nh, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, nkv, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh|nkv, T, hd)
        y = self.core(q, k, v)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, h)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, f) -> (B, T, h)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The full decoder, or one pipeline chunk of it (see module docstring)."""

    rope_cos: torch.Tensor  # (seq_len, head_dim / 2) buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab, bias=False)
        cos, sin = rope_tables(args.head_dim, args.seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) int64 if this chunk embeds, else hidden (B, T, h); logits (B, T, V) from the last."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, h)
        T = h.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic, split-independent init (module docstring); also rebuilds the rotary tables."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.args.n_layers)  # residual projections, as GPT-2 / torchtitan
        for name, param in self.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                value = torch.ones(param.shape)
            elif name == "tok_embeddings.weight":
                value = torch.randn(param.shape, generator=gen)
            elif name == "output.weight":
                value = torch.randn(param.shape, generator=gen) * self.args.dim**-0.5
            else:
                s = out_std if name.endswith(("wo.weight", "w2.weight")) else std
                value = torch.randn(param.shape, generator=gen) * s
            param.copy_(value.to(param.dtype))
        cos, sin = rope_tables(self.args.head_dim, self.args.seq_len, self.args.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of a microbatch: logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
