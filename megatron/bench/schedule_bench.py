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


def rank_busy_ms(records: list[dict], shares: dict[int, float]) -> list[float]:
    """Each rank's forward + backward ms per iteration after the first, in rank order: its
    share of the run (the trainer's closing '[train] rank R:' line, which leaves the first
    iteration out) times the mean time of the iterations after the first (the first pays
    one-time costs: on the T5 run about 2.5x a later iteration)."""
    later = [rec["iteration_s"] for rec in records if rec["iteration"] > 1]
    if not later:
        raise ValueError("rank_busy_ms: the run has no iteration after the first")
    whole = 1e3 * sum(later) / len(later)
    return [shares[r] * whole for r in sorted(shares)]


def predicted_rank_compute_ms(per_iteration: list[list[float]]) -> list[float]:
    """Each rank's predicted forward + backward ms per iteration after the first (as
    rank_busy_ms measures it), from one list of per-rank ms per iteration."""
    later = per_iteration[1:] or per_iteration
    return [sum(it[r] for it in later) / len(later) for r in range(len(per_iteration[0]))]
