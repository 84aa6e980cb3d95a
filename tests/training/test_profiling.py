"""--profile (torch.profiler over a window of iterations), Megatron's fusion switches, and the
cost profile's layers in the model dtype."""
import json
import subprocess
import sys

import pytest
import torch

from megatron.training.arguments import parse_args
from tests.multiproc import free_port
from tests.training.test_training import REPO, TINY_MODEL, env_with_repo, sp_dataset  # noqa: F401

BASE = ["--data-path", "data/flan", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--train-iters", "4"]


def test_fusion_flags_switch_off_one_fusion_each():
    from megatron.model.stages import ModelSpec, build_transformer_config
    spec = ModelSpec("gpt", 2, 64, 4, 128, max_position_embeddings=64)
    both = build_transformer_config(spec, fused=True)
    assert both.bias_activation_fusion and both.bias_dropout_fusion
    no_gelu = build_transformer_config(spec, fused=True, fuse_bias_gelu=False)
    assert not no_gelu.bias_activation_fusion and no_gelu.bias_dropout_fusion
    no_bda = build_transformer_config(spec, fused=True, fuse_bias_dropout=False)
    assert no_bda.bias_activation_fusion and not no_bda.bias_dropout_fusion
    cfg = parse_args("gpt", BASE + ["--no-bias-gelu-fusion", "--no-bias-dropout-fusion"],
                     has_cuda=False)
    assert (cfg.bias_gelu_fusion, cfg.bias_dropout_fusion) == (False, False)
    cfg = parse_args("gpt", BASE, has_cuda=False)
    assert (cfg.bias_gelu_fusion, cfg.bias_dropout_fusion) == (True, True)


def test_profile_window_must_not_be_empty(capsys):
    with pytest.raises(SystemExit):
        parse_args("gpt", BASE + ["--profile", "--profile-step-start", "3",
                                  "--profile-step-end", "3"], has_cuda=False)
    assert "--profile-step-start < --profile-step-end" in capsys.readouterr().err


def test_cost_profile_layers_are_in_the_model_dtype():
    """The profiled layers run in the model dtype as the stages do (megatron-core would leave
    position embeddings and local-spec norms fp32, which CUDA's bf16 kernels refuse)."""
    from megatron.planning.profile_layers import EMBEDDING, GPT_LAYER, ProfiledLayer
    from megatron.model.stages import ModelSpec, build_transformer_config
    from megatron.base.distributed_setup import setup_model_parallel
    setup_model_parallel(1, 1, seed=1)
    spec = ModelSpec("gpt", 1, 64, 4, 128, max_position_embeddings=64)
    config = build_transformer_config(spec, dtype="bfloat16")
    for kind in (EMBEDDING, GPT_LAYER):
        dtypes = {name: p.dtype for name, p in ProfiledLayer(kind, spec, config).named_parameters()}
        assert set(dtypes.values()) == {torch.bfloat16}, dtypes


@pytest.mark.slow
def test_profile_prints_the_costliest_ops_and_writes_traces(sp_dataset, tmp_path):
    """A PP=2 CPU run profiled on both ranks over iterations 2-3: each rank prints its table
    and writes a Chrome trace; the run ends cleanly (exit 0)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "pretrain_gpt.py",
           *sp_dataset, *TINY_MODEL, "--pipeline-model-parallel-size", "2",
           "--seq-length", "128", "--micro-batching", "dynamic", "--train-iters", "4",
           "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
           "--profile-ranks", "0", "1", "--profile-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for rank in (0, 1):
        assert (f"[profile] rank {rank}, iterations 2..3 (1-based), costliest ops by "
                "self_cpu_time_total") in done.stdout
        trace = json.loads((tmp_path / f"profile_rank{rank}_iters2-3.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names
    assert "aten::mm" in done.stdout or "aten::addmm" in done.stdout
