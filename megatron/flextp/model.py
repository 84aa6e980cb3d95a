"""A small GPT whose attention and MLP are FlexTP blocks (pre-LayerNorm, learned positions,
embedding tied to the output). Everything outside the blocks is replicated on the TP ranks, whose
inputs are identical after each all-reduce, so its gradients agree without communication."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynapipe_ext.flextp.partition import Partition
from megatron.flextp.layers import FlexAttention, FlexMLP, init_full


@dataclass(frozen=True)
class FlexGPTConfig:
    vocab_size: int = 256
    seq_length: int = 128
    hidden: int = 256
    num_layers: int = 2
    num_heads: int = 8
    ffn: int = 1024
    ffn_unit: int = 32       # ffn columns per MLP unit

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def mlp_units(self) -> int:
        return self.ffn // self.ffn_unit

    def check(self) -> None:
        if self.hidden % self.num_heads or self.ffn % self.ffn_unit:
            raise ValueError(f"FlexGPTConfig: hidden {self.hidden} must divide by heads "
                             f"{self.num_heads} and ffn {self.ffn} by ffn_unit {self.ffn_unit}")


class FlexLayer(torch.nn.Module):
    def __init__(self, cfg: FlexGPTConfig, parts: dict, rank: int, group, slowdown: int):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(cfg.hidden)
        self.attn = FlexAttention(cfg.hidden, cfg.head_dim, parts["attn"], rank, group, slowdown)
        self.ln2 = torch.nn.LayerNorm(cfg.hidden)
        self.mlp = FlexMLP(cfg.hidden, cfg.ffn, cfg.ffn_unit, parts["mlp"], rank, group, slowdown)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class FlexGPT(torch.nn.Module):
    def __init__(self, cfg: FlexGPTConfig, parts: dict[str, Partition], rank: int, group=None,
                 seed: int = 1234, slowdown: int = 1):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = torch.nn.Embedding(cfg.seq_length, cfg.hidden)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(cfg.vocab_size, cfg.hidden, generator=gen) * 0.02)
            self.pos.weight.copy_(torch.randn(cfg.seq_length, cfg.hidden, generator=gen) * 0.02)
        self.layers = torch.nn.ModuleList(
            FlexLayer(cfg, parts, rank, group, slowdown) for _ in range(cfg.num_layers))
        for layer in self.layers:
            # full tensors drawn in the same order on every rank, whatever the partition
            layer.attn.load_full(init_full(cfg.hidden, cfg.num_heads, 3 * cfg.head_dim,
                                           cfg.head_dim, gen, cfg.num_layers))
            layer.mlp.load_full(init_full(cfg.hidden, cfg.mlp_units, cfg.ffn_unit, cfg.ffn_unit,
                                          gen, cfg.num_layers))
        self.ln_f = torch.nn.LayerNorm(cfg.hidden)

    def blocks(self, kind: str):
        return [getattr(layer, kind) for layer in self.layers]

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over [batch, seq] tokens."""
        pos = torch.arange(tokens.shape[1])
        x = self.embed(tokens) + self.pos(pos)[None]
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.ln_f(x), self.embed.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
