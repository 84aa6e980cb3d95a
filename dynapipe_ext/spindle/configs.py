"""Multi-task multi-modal configurations shaped like the Spindle paper's workloads (numbers of
tasks and modalities, relative component sizes), and an accelerator model that turns layer
sizes into profile points for the estimator. These are for simulation: the device figures
are assumptions stated here, not measurements."""
from __future__ import annotations

from dataclasses import dataclass

from .estimator import CommModel, Estimator, LayerFit, fit_layer
from .model import Component, MTModel, Task, TaskStep


def _layer(name: str, role: str, hidden: int, layers: int) -> Component:
    """A transformer component of width `hidden` (12 h^2 parameters per layer)."""
    return Component(name, role, f"tf{hidden}", layers, 12 * hidden * hidden, hidden)


def _head(name: str, hidden: int, out: int) -> Component:
    return Component(name, "head", f"head{hidden}x{out}", 1, hidden * out, out)


def multitask_clip() -> MTModel:
    """ImageBind / Multitask-CLIP shape: six modality encoders, no shared backbone, ten
    contrastive tasks over modality pairs; the text and image encoders are shared by many."""
    enc = {"image": _layer("image_enc", "encoder", 1024, 24),
           "text": _layer("text_enc", "encoder", 768, 12),
           "audio": _layer("audio_enc", "encoder", 768, 12),
           "depth": _layer("depth_enc", "encoder", 384, 12),
           "thermal": _layer("thermal_enc", "encoder", 768, 12),
           "imu": _layer("imu_enc", "encoder", 512, 6)}
    seq = {"image": 257, "text": 77, "audio": 229, "depth": 257, "thermal": 257, "imu": 250}
    pairs = [("image", "text", 64), ("audio", "text", 32), ("depth", "image", 16),
             ("thermal", "image", 16), ("imu", "image", 16), ("audio", "image", 24),
             ("depth", "text", 8), ("thermal", "text", 8), ("imu", "text", 8),
             ("image", "audio", 16)]
    heads = {}
    tasks = []
    for a, b, batch in pairs:
        head = Component(f"proj_{a}_{b}", "head", "proj", 1,
                         enc[a].hidden_size * 512 + enc[b].hidden_size * 512, 512)
        heads[head.name] = head
        tasks.append(Task(f"{a}-{b}", batch, (
            TaskStep(enc[a].name, seq[a]), TaskStep(enc[b].name, seq[b]),
            TaskStep(head.name, 1, (enc[a].name, enc[b].name)))))
    return MTModel(tuple(enc.values()) + tuple(heads.values()), tuple(tasks))


def ofa_multitask() -> MTModel:
    """OFASys shape: a large shared encoder-decoder backbone, small modality adapters (image
    patches, audio frames, text, video, motion) and eight tasks with very different data
    sizes and their own heads."""
    h = 1024
    comps = [_layer("text_adapt", "encoder", h, 1), _layer("image_adapt", "encoder", h, 4),
             _layer("audio_adapt", "encoder", h, 4), _layer("video_adapt", "encoder", h, 6),
             _layer("motion_adapt", "encoder", h, 2),
             _layer("backbone_enc", "backbone", h, 12), _layer("backbone_dec", "backbone", h, 12)]
    tasks_spec = [("caption", "image_adapt", 32, 256, 32), ("vqa", "image_adapt", 32, 300, 8),
                  ("asr", "audio_adapt", 16, 500, 64), ("summarise", "text_adapt", 32, 512, 128),
                  ("translate", "text_adapt", 48, 128, 128), ("video_qa", "video_adapt", 8, 1024, 16),
                  ("text2motion", "motion_adapt", 16, 64, 196), ("mnli", "text_adapt", 64, 128, 4)]
    tasks = []
    for name, adapter, batch, enc_len, dec_len in tasks_spec:
        head = _head(f"{name}_head", h, 4096 if dec_len > 8 else 16)
        comps.append(head)
        tasks.append(Task(name, batch, (
            TaskStep(adapter, enc_len), TaskStep("backbone_enc", enc_len, (adapter,)),
            TaskStep("backbone_dec", dec_len, ("backbone_enc",)),
            TaskStep(head.name, dec_len, ("backbone_dec",)))))
    return MTModel(tuple(comps), tuple(tasks))


def vision_audio_llm() -> MTModel:
    """QWen-VAL shape: a 7B-class language backbone shared by text, image-text and audio-text
    tasks, a ViT vision encoder and a Whisper-style audio encoder, per-task LM heads."""
    comps = (_layer("vision_enc", "encoder", 1664, 48), _layer("audio_enc", "encoder", 1280, 32),
             _layer("vision_proj", "encoder", 4096, 1), _layer("audio_proj", "encoder", 4096, 1),
             _layer("llm", "backbone", 4096, 32), _head("lm_head", 4096, 32000),
             _head("cls_head", 4096, 64))
    tasks = (
        Task("text", 32, (TaskStep("llm", 1024), TaskStep("lm_head", 1024, ("llm",)))),
        Task("image_caption", 64, (TaskStep("vision_enc", 256),
                                   TaskStep("vision_proj", 256, ("vision_enc",)),
                                   TaskStep("llm", 320, ("vision_proj",)),
                                   TaskStep("lm_head", 320, ("llm",)))),
        Task("audio_asr", 32, (TaskStep("audio_enc", 750),
                               TaskStep("audio_proj", 188, ("audio_enc",)),
                               TaskStep("llm", 256, ("audio_proj",)),
                               TaskStep("lm_head", 256, ("llm",)))),
        Task("audio_cls", 64, (TaskStep("audio_enc", 500),
                               TaskStep("audio_proj", 125, ("audio_enc",)),
                               TaskStep("llm", 128, ("audio_proj",)),
                               TaskStep("cls_head", 1, ("llm",)))),
    )
    return MTModel(comps, tasks)


CONFIGS = {"multitask-clip": multitask_clip, "ofa-multitask": ofa_multitask,
           "vision-audio-llm": vision_audio_llm}
# configurations whose activations only fit 80 GiB devices with full activation recompute
FULL_RECOMPUTE = {"vision-audio-llm"}


@dataclass(frozen=True)
class Accelerator:
    """Assumed accelerator: dense-math rate, per-layer launch overhead and the tokens at which
    it reaches half its rate (utilisation = tokens / (tokens + half_tokens))."""
    flops: float = 400e12
    launch_s: float = 3e-4
    half_tokens: float = 1024.0

    def layer_time(self, params: int, tokens: float) -> float:
        """Forward + backward seconds of a layer with `params` weights on `tokens` tokens."""
        work = 6.0 * params * tokens
        return self.launch_s + work / (self.flops * tokens / (tokens + self.half_tokens))


def simulated_estimator(model: MTModel, acc: Accelerator = Accelerator(),
                        comm: CommModel = CommModel(2e-5, 1 / 50e9),
                        full_recompute: bool = False) -> Estimator:
    """An Estimator fitted, like the real one, to profile points - here produced by the
    accelerator model at a few token counts (what a 1-device profile would measure). Full
    recompute keeps only each layer's input (factor 1) and repeats the forward (x 4/3)."""
    slow = 4 / 3 if full_recompute else 1.0
    fits: dict[str, LayerFit] = {}
    for c in model.components:
        points = [(t, slow * acc.layer_time(c.params_per_layer, t))
                  for t in (256, 1024, 4096, 16384)]
        fits[c.layer_kind] = fit_layer(points, where=f"layer kind {c.layer_kind}")
    return Estimator(fits, comm, activation_factor=1.0 if full_recompute else 16.0)
