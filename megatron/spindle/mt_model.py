"""A small multi-task multi-modal model built from megatron-core blocks, for Spindle's runtime:
three modality encoders (text bytes, image patches, audio frames), a shared backbone and one
head per task, with seeded data for each task and its description for the planner."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                         TransformerBlockSubmodules)
from megatron.core.transformer.transformer_config import TransformerConfig

from dynapipe_ext.spindle.model import Component, MTModel, Task, TaskStep
from megatron.data.flan_synthetic import synthetic_samples
from megatron.model.init_weights import initialize_parameters

BYTE_VOCAB = 256
IMAGE_SIZE, PATCH = 16, 4                 # 16 patches of 4x4 pixels
AUDIO_FEATURES = 8                        # features per audio frame
IMAGE_CLASSES, AUDIO_CLASSES = 10, 4


@dataclass(frozen=True)
class TinyMTConfig:
    """Sizes of the small model and of one iteration's data per task."""
    hidden: int = 32
    heads: int = 2
    encoder_layers: int = 1
    backbone_layers: int = 2
    text_batch: int = 6
    text_len: int = 24
    image_batch: int = 8
    audio_batch: int = 4
    audio_frames: int = 20

    def seq_len(self, task: str) -> int:
        return {"text_lm": self.text_len, "image_cls": (IMAGE_SIZE // PATCH) ** 2,
                "audio_cls": self.audio_frames}[task]

    def batch(self, task: str) -> int:
        return {"text_lm": self.text_batch, "image_cls": self.image_batch,
                "audio_cls": self.audio_batch}[task]


TASKS = ("text_lm", "image_cls", "audio_cls")
ENCODER_OF = {"text_lm": "text_enc", "image_cls": "image_enc", "audio_cls": "audio_enc"}
HEAD_OF = {"text_lm": "lm_head", "image_cls": "image_head", "audio_cls": "audio_head"}


def transformer_config(cfg: TinyMTConfig) -> TransformerConfig:
    return TransformerConfig(
        num_layers=cfg.backbone_layers, hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads, ffn_hidden_size=2 * cfg.hidden, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, use_cpu_initialization=True,
        perform_initialization=False, bias_dropout_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, cuda_graph_scope=[])


def _block(config: TransformerConfig, num_layers: int) -> TransformerBlock:
    spec = TransformerBlockSubmodules(layer_specs=[get_gpt_layer_local_spec()] * num_layers,
                                      layer_norm=None)
    return TransformerBlock(config, spec, post_layer_norm=False, pre_process=True,
                            post_process=False)


def causal_mask(seq: int) -> torch.Tensor:
    """Explicit bool mask (True = masked out), as megatron-core's local attention wants."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


class Encoder(torch.nn.Module):
    """Modality input (byte ids, flattened patches or frames) -> embedding + positions ->
    transformer block; output [seq, batch, hidden]."""

    def __init__(self, config: TransformerConfig, cfg: TinyMTConfig, modality: str):
        super().__init__()
        self.modality = modality
        if modality == "text":
            self.embed = torch.nn.Embedding(BYTE_VOCAB, cfg.hidden)
        else:
            width = PATCH * PATCH if modality == "image" else AUDIO_FEATURES
            self.embed = torch.nn.Linear(width, cfg.hidden)
        self.position = torch.nn.Embedding(max(cfg.text_len, cfg.audio_frames, 16), cfg.hidden)
        self.block = _block(config, cfg.encoder_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)                                   # [b, s, hidden]
        h = h + self.position.weight[: h.shape[1]]
        h = h.transpose(0, 1).contiguous()                  # [s, b, hidden]
        return self.block(h, attention_mask=causal_mask(h.shape[0]))


class Backbone(torch.nn.Module):
    def __init__(self, config: TransformerConfig, cfg: TinyMTConfig):
        super().__init__()
        self.block = _block(config, cfg.backbone_layers)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h, attention_mask=causal_mask(h.shape[0]))


class Head(torch.nn.Module):
    """Per-sample loss sums: next-byte cross-entropy summed over a sample's tokens (LM), or the
    cross-entropy of the mean-pooled class logits (classification)."""

    def __init__(self, cfg: TinyMTConfig, outputs: int, lm: bool):
        super().__init__()
        self.lm = lm
        self.norm = torch.nn.LayerNorm(cfg.hidden)
        self.proj = torch.nn.Linear(cfg.hidden, outputs)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        if self.lm:
            logits = self.proj(h[:-1]).transpose(0, 1)       # [b, s-1, vocab]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                reduction="none")
            return loss.view(labels.shape[0], -1).sum(dim=1)
        logits = self.proj(h.mean(dim=0))
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none")


def build_components(cfg: TinyMTConfig, seed: int) -> torch.nn.ModuleDict:
    """Every component, weights set from `seed` by parameter name (the same on every rank)."""
    config = transformer_config(cfg)
    comps = torch.nn.ModuleDict({
        "text_enc": Encoder(config, cfg, "text"), "image_enc": Encoder(config, cfg, "image"),
        "audio_enc": Encoder(config, cfg, "audio"), "backbone": Backbone(config, cfg),
        "lm_head": Head(cfg, BYTE_VOCAB, lm=True),
        "image_head": Head(cfg, IMAGE_CLASSES, lm=False),
        "audio_head": Head(cfg, AUDIO_CLASSES, lm=False)})
    with torch.no_grad():
        initialize_parameters(comps.named_parameters(), seed, num_layers=cfg.backbone_layers)
        for name, p in comps.named_parameters():    # LayerNorm weights start at one
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
    return comps


def task_data(cfg: TinyMTConfig, seed: int, iteration: int = 0) -> dict[str, tuple]:
    """(inputs, labels) of every task for one iteration, the same on every rank.
    text_lm: FLAN-like text (the project's synthetic FLAN generator) as byte windows;
    image_cls: seeded class-dependent noise images cut into 4x4 patches;
    audio_cls: seeded noisy sine frames whose frequency is the class."""
    gen = torch.Generator().manual_seed(seed * 1000 + iteration)
    text = []
    for sample in synthetic_samples(cfg.text_batch, seed=seed + iteration):
        data = (sample["inputs"] + " " + sample["targets"]).encode()
        data = (data * (cfg.text_len // max(len(data), 1) + 1))[: cfg.text_len]
        text.append(list(data))
    text = torch.tensor(text, dtype=torch.long)
    img_labels = torch.randint(0, IMAGE_CLASSES, (cfg.image_batch,), generator=gen)
    images = torch.randn(cfg.image_batch, IMAGE_SIZE, IMAGE_SIZE, generator=gen) * 0.5
    images += img_labels[:, None, None].float() / IMAGE_CLASSES
    patches = images.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH).reshape(
        cfg.image_batch, -1, PATCH * PATCH)
    aud_labels = torch.randint(0, AUDIO_CLASSES, (cfg.audio_batch,), generator=gen)
    t = torch.arange(cfg.audio_frames * AUDIO_FEATURES).float().view(cfg.audio_frames, -1)
    audio = torch.sin(t[None] * (aud_labels[:, None, None].float() + 1) * 0.1)
    audio = audio + 0.1 * torch.randn(audio.shape, generator=gen)
    return {"text_lm": (text, text), "image_cls": (patches, img_labels),
            "audio_cls": (audio, aud_labels)}


def loss_normaliser(cfg: TinyMTConfig, task: str) -> int:
    """What a task's summed per-sample losses are divided by: its loss tokens (LM) or samples;
    every task weighs 1 in the total loss, however its samples are split."""
    return cfg.text_batch * (cfg.text_len - 1) if task == "text_lm" else cfg.batch(task)


def describe(cfg: TinyMTConfig, comps: torch.nn.ModuleDict) -> MTModel:
    """The planner's view of this model (parameter counts from the real modules)."""
    def params(name: str) -> int:
        return sum(p.numel() for p in comps[name].parameters())

    components = []
    for name in ("text_enc", "image_enc", "audio_enc"):
        components.append(Component(name, "encoder", f"enc-{name}", cfg.encoder_layers,
                                    params(name) // cfg.encoder_layers, cfg.hidden))
    components.append(Component("backbone", "backbone", "backbone", cfg.backbone_layers,
                                params("backbone") // cfg.backbone_layers, cfg.hidden))
    for name in HEAD_OF.values():
        components.append(Component(name, "head", f"head-{name}", 1, params(name), cfg.hidden))
    tasks = []
    for task in TASKS:
        s = cfg.seq_len(task)
        enc, head = ENCODER_OF[task], HEAD_OF[task]
        tasks.append(Task(task, cfg.batch(task), (
            TaskStep(enc, s), TaskStep("backbone", s, (enc,)), TaskStep(head, s, ("backbone",)))))
    return MTModel(tuple(components), tuple(tasks))


def reference_step(comps: torch.nn.ModuleDict, cfg: TinyMTConfig, data) -> torch.Tensor:
    """The single-process iteration every Spindle plan must reproduce: each task through its
    encoder, the backbone and its head on all its samples; returns the loss after backward."""
    total = torch.zeros(())
    for task in TASKS:
        x, labels = data[task]
        h = comps["backbone"](comps[ENCODER_OF[task]](x))
        total = total + comps[HEAD_OF[task]](h, labels).sum() / loss_normaliser(cfg, task)
    total.backward()
    return total.detach()
