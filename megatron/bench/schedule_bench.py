"""The runs of tools/bench_pipeline_training.py: the quickstart data, a small GPT and T5 and one
flag set per pipeline schedule at PP=2 (1f1b and adaptive on 2 stages, interleaved v=2 and wave
W=1 on 4 virtual stages, auto), as pretrain_gpt.py / pretrain_t5.py flags."""
from __future__ import annotations

from pathlib import Path

DATA = ["--data-path", "data/quickstart/flan", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", "data/quickstart/sp.model"]
MODELS = {
    "gpt": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "512", "--tokens-per-global-batch", "8192", "--lr", "3e-3"],
    "t5": ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "128",
           "--num-attention-heads", "4", "--encoder-seq-length", "512",
           "--decoder-seq-length", "128", "--tokens-per-global-batch", "4096", "--lr", "1e-3"],
}
SCHEDULES = {
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "adaptive": ["--pipeline-schedule", "adaptive"],
    "interleaved v=2": ["--pipeline-schedule", "interleaved",
                        "--num-virtual-stages-per-pipeline-rank", "2"],
    "wave W=1": ["--pipeline-schedule", "wave", "--pipeline-waves", "1"],
    "auto": ["--pipeline-schedule", "auto"],
}
COMMON = ["--pipeline-model-parallel-size", "2", "--micro-batching", "dynamic",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1"]


def run_argv(model: str, schedule: str, iters: int, stats: Path) -> list[str]:
    return (DATA + MODELS[model] + COMMON + SCHEDULES[schedule]
            + ["--train-iters", str(iters), "--stats-file", str(stats)])
