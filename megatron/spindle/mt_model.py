"""A small multi-task multi-modal model built from megatron-core blocks, for Spindle's runtime:
three modality encoders (text bytes, image patches, audio frames), a shared backbone, one head
per task and a two-input contrastive image-text head, with seeded data for each task and its
description for the planner. Every component is built on its own, weights drawn from a seed
by parameter name, so any placement starts from the reference's weights."""
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
    clip_batch: int = 6
    clip_dim: int = 16
    text_layers: int = 0          # 0: encoder_layers
    vocab_size: int = BYTE_VOCAB  # text token ids: bytes, or a tokenizer's (flan_task_data)

    def layers(self, component: str) -> int:
        if component == "backbone":
            return self.backbone_layers
        if component == "text_enc" and self.text_layers:
            return self.text_layers
        return self.encoder_layers if component.endswith("_enc") else 1

    def seq_len(self, task: str) -> int:
        return {"text_lm": self.text_len, "image_cls": (IMAGE_SIZE // PATCH) ** 2,
                "audio_cls": self.audio_frames, "image_text": 1}[task]

    def batch(self, task: str) -> int:
        return {"text_lm": self.text_batch, "image_cls": self.image_batch,
                "audio_cls": self.audio_batch, "image_text": self.clip_batch}[task]


TASKS = ("text_lm", "image_cls", "audio_cls", "image_text")
ENCODER_OF = {"text_lm": "text_enc", "image_cls": "image_enc", "audio_cls": "audio_enc"}
HEAD_OF = {"text_lm": "lm_head", "image_cls": "image_head", "audio_cls": "audio_head",
           "image_text": "clip_head"}
COMPONENTS = ("text_enc", "image_enc", "audio_enc", "backbone", "lm_head", "image_head",
              "audio_head", "clip_head")
# each task's steps in order: (component, the components whose outputs it reads)
GRAPH = {task: ((enc, ()), ("backbone", (enc,)), (HEAD_OF[task], ("backbone",)))
         for task, enc in ENCODER_OF.items()}
GRAPH["image_text"] = (("text_enc", ()), ("image_enc", ()),
                       ("clip_head", ("text_enc", "image_enc")))
ENCODER_SEQ = {"text_enc": "text_lm", "image_enc": "image_cls", "audio_enc": "audio_cls"}


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

    def __init__(self, config: TransformerConfig, cfg: TinyMTConfig, modality: str,
                 layers: int):
        super().__init__()
        self.modality = modality
        if modality == "text":
            self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden)
        else:
            width = PATCH * PATCH if modality == "image" else AUDIO_FEATURES
            self.embed = torch.nn.Linear(width, cfg.hidden)
        self.position = torch.nn.Embedding(max(cfg.text_len, cfg.audio_frames, 16), cfg.hidden)
        self.block = _block(config, layers)

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




class ContrastiveHead(torch.nn.Module):
    """Two inputs (text and image hidden states, [seq, b, hidden] each): mean-pooled, projected
    and normalised; per-sample symmetric InfoNCE against every pair of the task's batch.
    `labels` are the global batch indices of the local samples' partners; `gather` (when the
    batch is split over ranks) returns the whole batch's rows from the local ones."""
    couples_batch = True

    def __init__(self, cfg: TinyMTConfig, scale: float = 10.0):
        super().__init__()
        self.scale = scale
        self.norm_text = torch.nn.LayerNorm(cfg.hidden)
        self.norm_image = torch.nn.LayerNorm(cfg.hidden)
        self.proj_text = torch.nn.Linear(cfg.hidden, cfg.clip_dim)
        self.proj_image = torch.nn.Linear(cfg.hidden, cfg.clip_dim)

    def forward(self, text: torch.Tensor, image: torch.Tensor, labels: torch.Tensor,
                gather=None) -> torch.Tensor:
        zt = torch.nn.functional.normalize(self.proj_text(self.norm_text(text).mean(0)), dim=-1)
        zi = torch.nn.functional.normalize(self.proj_image(self.norm_image(image).mean(0)),
                                           dim=-1)
        both = torch.cat([zt, zi], dim=1)
        every = both if gather is None else gather(both)
        all_t, all_i = every.split(zt.shape[1], dim=1)
        t2i = torch.nn.functional.cross_entropy(self.scale * zt @ all_i.T, labels,
                                                reduction="none")
        i2t = torch.nn.functional.cross_entropy(self.scale * zi @ all_t.T, labels,
                                                reduction="none")
        return 0.5 * (t2i + i2t)


def _make(cfg: TinyMTConfig, name: str) -> torch.nn.Module:
    if name not in COMPONENTS:
        raise ValueError(f"unknown component {name!r}; the model has {COMPONENTS}")
    if name.endswith("_enc"):
        return Encoder(transformer_config(cfg), cfg, name[:-4], cfg.layers(name))
    if name == "backbone":
        return Backbone(transformer_config(cfg), cfg)
    if name == "clip_head":
        return ContrastiveHead(cfg)
    outputs = {"lm_head": cfg.vocab_size, "image_head": IMAGE_CLASSES, "audio_head": AUDIO_CLASSES}
    return Head(cfg, outputs[name], lm=name == "lm_head")


def build_component(cfg: TinyMTConfig, name: str, seed: int) -> torch.nn.Module:
    """One component, its weights drawn from `seed` by "<component>.<parameter>" name (the
    same values on every rank and in the whole-model reference)."""
    module = _make(cfg, name)
    with torch.no_grad():
        named = ((f"{name}.{n}", p) for n, p in module.named_parameters())
        initialize_parameters(named, seed, num_layers=cfg.backbone_layers)
    return module


def build_components(cfg: TinyMTConfig, seed: int) -> torch.nn.ModuleDict:
    """Every component (the single-process reference; profiling)."""
    return torch.nn.ModuleDict({name: build_component(cfg, name, seed) for name in COMPONENTS})


def parameter_counts(cfg: TinyMTConfig) -> dict[str, int]:
    """Parameters per component, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return {name: sum(p.numel() for p in _make(cfg, name).parameters())
                for name in COMPONENTS}


def _step_seq(cfg: TinyMTConfig, task: str, component: str) -> int:
    return cfg.seq_len(ENCODER_SEQ[component]) if component in ENCODER_SEQ else cfg.seq_len(task)


def describe(cfg: TinyMTConfig, comps=None) -> MTModel:
    """The planner's view of this model (parameter counts of the real modules; `comps` is
    ignored, kept for older callers)."""
    counts = parameter_counts(cfg)
    components = []
    for name in COMPONENTS:
        role = ("encoder" if name.endswith("_enc") else
                "backbone" if name == "backbone" else "head")
        layers = cfg.layers(name)
        kind = f"enc-{name}" if role == "encoder" else name if role == "backbone" \
            else f"head-{name}"
        components.append(Component(name, role, kind, layers, counts[name] // layers,
                                    cfg.clip_dim if name == "clip_head" else cfg.hidden))
    tasks = tuple(Task(task, cfg.batch(task), tuple(
        TaskStep(comp, _step_seq(cfg, task, comp), inputs) for comp, inputs in GRAPH[task]))
        for task in TASKS)
    return MTModel(tuple(components), tasks)


def _text_windows(cfg: TinyMTConfig, count: int, seed: int) -> torch.Tensor:
    rows = []
    for sample in synthetic_samples(count, seed=seed):
        data = (sample["inputs"] + " " + sample["targets"]).encode()
        rows.append(list((data * (cfg.text_len // max(len(data), 1) + 1))[: cfg.text_len]))
    return torch.tensor(rows, dtype=torch.long)


def _patches(images: torch.Tensor) -> torch.Tensor:
    return images.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH).reshape(
        images.shape[0], -1, PATCH * PATCH)


def task_data(cfg: TinyMTConfig, seed: int, iteration: int = 0) -> dict[str, tuple]:
    """(inputs, labels) of every task for one iteration, the same on every rank; a task with
    several data-reading components has a dict component -> inputs.
    text_lm: FLAN-like text (the project's synthetic FLAN generator) as byte windows;
    image_cls: seeded class-dependent noise images cut into 4x4 patches;
    audio_cls: seeded noisy sine frames whose frequency is the class;
    image_text: FLAN-like text paired with images; labels are each sample's partner index."""
    gen = torch.Generator().manual_seed(seed * 1000 + iteration)
    text = _text_windows(cfg, cfg.text_batch, seed + iteration)
    img_labels = torch.randint(0, IMAGE_CLASSES, (cfg.image_batch,), generator=gen)
    images = torch.randn(cfg.image_batch, IMAGE_SIZE, IMAGE_SIZE, generator=gen) * 0.5
    images += img_labels[:, None, None].float() / IMAGE_CLASSES
    aud_labels = torch.randint(0, AUDIO_CLASSES, (cfg.audio_batch,), generator=gen)
    t = torch.arange(cfg.audio_frames * AUDIO_FEATURES).float().view(cfg.audio_frames, -1)
    audio = torch.sin(t[None] * (aud_labels[:, None, None].float() + 1) * 0.1)
    audio = audio + 0.1 * torch.randn(audio.shape, generator=gen)
    pair_text = _text_windows(cfg, cfg.clip_batch, seed + iteration + 7919)
    pair_images = torch.randn(cfg.clip_batch, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    pair_images += pair_text[:, :IMAGE_SIZE, None].float() / BYTE_VOCAB
    return {"text_lm": (text, text), "image_cls": (_patches(images), img_labels),
            "audio_cls": (audio, aud_labels),
            "image_text": ({"text_enc": pair_text, "image_enc": _patches(pair_images)},
                           torch.arange(cfg.clip_batch))}


def _token_rows(dataset, order, starts, length: int) -> torch.Tensor:
    """One row per start: the samples order[start], order[start + 1], ... (input ++ target ++
    end-of-document each) as one token stream, cut to `length` tokens (GPT-style packing)."""
    rows = []
    for start in starts:
        row: list[int] = []
        k = start
        while len(row) < length:
            i = int(order[k % len(order)])
            row += dataset.input_ids(i).tolist() + dataset.target_ids(i).tolist() + [dataset.eod]
            k += 1
        rows.append(row[:length])
    return torch.tensor(rows, dtype=torch.long)


def flan_task_data(cfg: TinyMTConfig, dataset, seed: int, iteration: int) -> dict[str, tuple]:
    """As task_data, with the text of text_lm and image_text read from a tokenised FLAN dataset
    (`megatron.data.multitask_dataset.MultiTaskDataset`, written by tools/preprocess_flan.py):
    samples in a seeded order, iteration i taking the next rows; image_text pairs each text
    with an image drawn from its tokens. The same on every rank."""
    if cfg.vocab_size < dataset.vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} is smaller than the dataset's "
                         f"{dataset.vocab_size} ({dataset.prefix})")
    data = task_data(cfg, seed, iteration)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).numpy()
    text = _token_rows(dataset, order, range(iteration * cfg.text_batch,
                                             (iteration + 1) * cfg.text_batch), cfg.text_len)
    half = len(dataset) // 2
    pair_text = _token_rows(dataset, order, range(half + iteration * cfg.clip_batch,
                                                  half + (iteration + 1) * cfg.clip_batch),
                            cfg.text_len)
    gen = torch.Generator().manual_seed(seed * 1000 + iteration + 17)
    pair_images = torch.randn(cfg.clip_batch, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    pair_images += (pair_text[:, :IMAGE_SIZE, None] % 97).float() / 97
    data["text_lm"] = (text, text)
    data["image_text"] = ({"text_enc": pair_text, "image_enc": _patches(pair_images)},
                          torch.arange(cfg.clip_batch))
    return data


def loss_normaliser(cfg: TinyMTConfig, task: str) -> int:
    """What a task's summed per-sample losses are divided by: its loss tokens (LM) or samples;
    every task weighs 1 in the total loss, however its samples are split."""
    return cfg.text_batch * (cfg.text_len - 1) if task == "text_lm" else cfg.batch(task)


def task_forward(comps, task: str, x, labels) -> torch.Tensor:
    """Per-sample losses of one task on the whole batch, through its steps (GRAPH)."""
    outs: dict[str, torch.Tensor] = {}
    for comp, inputs in GRAPH[task]:
        if comp == HEAD_OF[task]:
            return comps[comp](*(outs[i] for i in inputs), labels)
        args = [outs[i] for i in inputs] or [x[comp] if isinstance(x, dict) else x]
        outs[comp] = comps[comp](*args)
    raise ValueError(f"task {task!r} has no head")


def reference_step(comps, cfg: TinyMTConfig, data) -> torch.Tensor:
    """The single-process iteration every Spindle plan must reproduce: each task through its
    components on all its samples; returns the loss after backward."""
    total = torch.zeros(())
    for task in TASKS:
        x, labels = data[task]
        total = total + task_forward(comps, task, x, labels).sum() / loss_normaliser(cfg, task)
    total.backward()
    return total.detach()
