"""Command-line parsing and up-front validation of pretrain_gpt.py / pretrain_t5.py."""
import numpy as np
import pytest

from megatron.training.arguments import (ConfigError, check_device_precision, check_world_size,
                                         parse_args)

BASE = ["--data-path", "data/flan", "--num-layers", "4", "--hidden-size", "128",
        "--num-attention-heads", "4", "--train-iters", "10"]


def parse_or_exit_message(capsys, model, argv, has_cuda=False):
    with pytest.raises(SystemExit) as exc:
        parse_args(model, BASE + argv, has_cuda=has_cuda)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_megatron_flag_names_reach_the_config():
    cfg = parse_args("gpt", BASE + ["--num-layers", "6", "--hidden-size", "96",
                                    "--num-attention-heads", "6", "--seq-length", "300",
                                    "--tensor-model-parallel-size", "2",
                                    "--pipeline-model-parallel-size", "3",
                                    "--tokens-per-global-batch", "8192", "--lr", "3e-4",
                                    "--micro-batching", "packing", "--pipeline-schedule", "wave",
                                    "--train-iters", "7"], has_cuda=False)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (6, 96, 6)
    assert cfg.seq_length == 300 and cfg.max_position_embeddings == 300
    assert cfg.ffn_hidden_size == 4 * 96
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 3)
    assert cfg.tokens_per_global_batch == 8192 and cfg.lr == 3e-4
    assert cfg.micro_batching == "packing" and cfg.pipeline_schedule == "wave"
    assert cfg.lr_decay_iters == 7  # defaults to --train-iters
    assert cfg.decoder_num_layers == 0 and cfg.decoder_seq_length == 0


def test_t5_layer_counts_and_lengths_follow_megatron_defaults():
    cfg = parse_args("t5", BASE + ["--num-layers", "3", "--encoder-seq-length", "256",
                                   "--decoder-seq-length", "64"], has_cuda=False)
    assert (cfg.num_layers, cfg.decoder_num_layers) == (3, 3)
    assert (cfg.seq_length, cfg.decoder_seq_length) == (256, 64)
    cfg = parse_args("t5", BASE + ["--encoder-num-layers", "2", "--decoder-num-layers", "4",
                                   "--pipeline-model-parallel-size", "3"], has_cuda=False)
    assert (cfg.num_layers, cfg.decoder_num_layers) == (2, 4)


def test_uneven_stage_split_is_rejected_naming_the_flag(capsys):
    err = parse_or_exit_message(capsys, "gpt", ["--num-layers", "5",
                                                "--pipeline-model-parallel-size", "2"])
    assert "5 transformer layers do not split evenly" in err
    assert "--pipeline-model-parallel-size 2" in err
    assert "--pipeline-split balanced" in err   # says how to run it anyway


def test_pipeline_split_lets_layers_cut_unevenly_and_checks_its_units(capsys):
    cfg = parse_args("gpt", BASE + ["--num-layers", "5", "--pipeline-model-parallel-size", "2",
                                    "--pipeline-split", "balanced"], has_cuda=False)
    assert cfg.pipeline_split == "balanced"
    assert parse_args("gpt", BASE + ["--pipeline-model-parallel-size", "2",
                                     "--pipeline-split", "5,3"],
                      has_cuda=False).pipeline_split == "5,3"
    bad = {"5,4": "sum to 2 x --num-layers = 8",
           "8,0": "sum to 2 x --num-layers = 8",
           "half": "must be even, balanced or half-layer units"}
    for value, message in bad.items():
        err = parse_or_exit_message(capsys, "gpt", ["--pipeline-model-parallel-size", "2",
                                                    "--pipeline-split", value])
        assert "--pipeline-split" in err and message in err, (value, err)
    err = parse_or_exit_message(capsys, "t5", ["--pipeline-model-parallel-size", "2",
                                               "--pipeline-split", "balanced"])
    assert "--pipeline-split balanced is implemented for GPT only" in err
    err = parse_or_exit_message(capsys, "gpt", ["--pipeline-split", "balanced"])
    assert "needs --pipeline-model-parallel-size > 1" in err


def test_several_problems_are_reported_together(capsys):
    err = parse_or_exit_message(capsys, "gpt", ["--hidden-size", "100",
                                                "--num-attention-heads", "3", "--lr", "-1"])
    assert "--hidden-size 100 is not divisible by --num-attention-heads 3" in err
    assert "--lr > 0" in err


def test_fp16_and_bf16_without_device_support_are_errors(capsys):
    assert "--fp16 is not supported" in parse_or_exit_message(capsys, "gpt", ["--fp16"])
    cfg = parse_args("gpt", BASE + ["--bf16"], has_cuda=False)   # CPU torch computes bf16
    assert cfg.bf16
    check_device_precision(cfg, has_cuda=False)
    check_device_precision(cfg, has_cuda=True, bf16_supported=True)
    with pytest.raises(ConfigError, match="does not support bfloat16"):
        check_device_precision(cfg, has_cuda=True, bf16_supported=False)


def test_t5_flags_on_gpt_are_rejected(capsys):
    err = parse_or_exit_message(capsys, "gpt", ["--decoder-num-layers", "2"])
    assert "are T5 flags" in err


def test_missing_tokenizer_files_are_named(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    err = parse_or_exit_message(capsys, "gpt", ["--vocab-file", str(missing)])
    assert f"--vocab-file {missing}: no such file" in err
    err = parse_or_exit_message(capsys, "t5", ["--tokenizer-type", "SentencePieceTokenizer"])
    assert "needs --tokenizer-model" in err


def test_cost_model_must_be_analytic_or_a_file(capsys, tmp_path):
    err = parse_or_exit_message(capsys, "gpt", ["--cost-model", str(tmp_path / "p.json")])
    assert "--cost-model" in err and "does not exist" in err
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    assert parse_args("gpt", BASE + ["--cost-model", str(profile)],
                      has_cuda=False).cost_model == str(profile)


def test_save_interval_needs_a_directory(capsys):
    assert "--save-interval needs --save" in parse_or_exit_message(capsys, "gpt",
                                                                    ["--save-interval", "5"])


@pytest.mark.parametrize("model,flag,value", [
    ("gpt", "--seq-length", "0"), ("gpt", "--tokens-per-global-batch", "0"),
    ("gpt", "--distributed-timeout-minutes", "0"), ("gpt", "--ffn-hidden-size", "0"),
    ("gpt", "--max-position-embeddings", "0"), ("gpt", "--kv-channels", "0"),
    ("gpt", "--num-layers", "0"), ("gpt", "--global-batch-size", "0"),
    ("gpt", "--lr-wsd-decay-iters", "0"), ("gpt", "--seq-length", "-3"),
    ("t5", "--seq-length", "0"), ("t5", "--encoder-seq-length", "0"),
    ("t5", "--decoder-seq-length", "0"), ("t5", "--encoder-num-layers", "0"),
    ("t5", "--decoder-num-layers", "0"),
])
def test_zero_where_it_means_nothing_is_an_error_not_the_default(capsys, model, flag, value):
    """`x or default` turned these into their defaults; a 0 the user wrote names the flag."""
    err = parse_or_exit_message(capsys, model, [flag, value])
    assert f"--{flag[2:]} must be > 0, got {value}" in err
    assert len(err.strip().splitlines()) == 1


def test_world_size_must_be_divisible_by_tp_times_pp():
    cfg = parse_args("gpt", BASE + ["--tensor-model-parallel-size", "2",
                                    "--pipeline-model-parallel-size", "2"], has_cuda=False)
    assert cfg.data_parallel_size(8) == 2
    with pytest.raises(ConfigError, match="world size 6 is not divisible by"):
        check_world_size(cfg, 6)


def test_cpu_timeout_default_is_short():
    assert parse_args("gpt", BASE, has_cuda=False).distributed_timeout_minutes <= 2
    assert parse_args("gpt", BASE + ["--distributed-timeout-minutes", "0.5"],
                      has_cuda=False).distributed_timeout_minutes == 0.5


@pytest.mark.parametrize("missing", ["--num-layers", "--hidden-size", "--num-attention-heads",
                                     "--train-iters"])
def test_model_size_and_train_iters_are_required_like_megatron(capsys, missing):
    argv = list(BASE)
    at = argv.index(missing)
    del argv[at:at + 2]
    for model in ("gpt", "t5"):
        with pytest.raises(SystemExit) as exc:
            parse_args(model, argv, has_cuda=False)
        assert exc.value.code == 2
        assert missing in capsys.readouterr().err


def test_t5_layers_can_come_from_the_encoder_and_decoder_flags(capsys):
    argv = [a for a in BASE]
    at = argv.index("--num-layers")
    del argv[at:at + 2]
    cfg = parse_args("t5", argv + ["--encoder-num-layers", "2", "--decoder-num-layers", "1",
                                   "--pipeline-model-parallel-size", "3"], has_cuda=False)
    assert (cfg.num_layers, cfg.decoder_num_layers) == (2, 1)
    with pytest.raises(SystemExit):
        parse_args("t5", argv + ["--encoder-num-layers", "2"], has_cuda=False)
    assert "--decoder-num-layers" in capsys.readouterr().err


def test_virtual_stage_size_counts_the_t5_encoder_and_decoder_flags():
    """Megatron's --num-layers-per-virtual-pipeline-stage divides all of T5's layers, the
    encoder's and the decoder's, also when they come from their own flags."""
    from megatron.training.arguments import pipeline_stage_count, virtual_stages
    argv = [a for a in BASE]
    at = argv.index("--num-layers")
    del argv[at:at + 2]
    cfg = parse_args("t5", argv + ["--encoder-num-layers", "6", "--decoder-num-layers", "6",
                                   "--pipeline-model-parallel-size", "2",
                                   "--pipeline-schedule", "interleaved",
                                   "--num-layers-per-virtual-pipeline-stage", "2"],
                     has_cuda=False)
    assert virtual_stages(cfg) == 3 and pipeline_stage_count(cfg) == 6   # 12 / (2 x 2)
    cfg = parse_args("t5", argv + ["--num-layers", "4", "--decoder-num-layers", "2",
                                   "--pipeline-model-parallel-size", "2",
                                   "--pipeline-schedule", "interleaved",
                                   "--num-layers-per-virtual-pipeline-stage", "1"],
                     has_cuda=False)
    assert virtual_stages(cfg) == 3      # 4 encoder + 2 decoder layers / (2 x 1)


def test_global_batch_size_in_samples_or_a_token_budget_not_both(capsys):
    cfg = parse_args("gpt", BASE + ["--global-batch-size", "16", "--seq-length", "256"],
                     has_cuda=False)
    assert cfg.global_batch_size == 16 and cfg.tokens_per_global_batch == 16 * 256
    t5 = parse_args("t5", BASE + ["--global-batch-size", "8", "--encoder-seq-length", "100",
                                  "--decoder-seq-length", "20"], has_cuda=False)
    assert t5.tokens_per_global_batch == 8 * 120
    default = parse_args("gpt", BASE, has_cuda=False)
    assert (default.global_batch_size, default.tokens_per_global_batch) == (0, 4096)
    err = parse_or_exit_message(capsys, "gpt", ["--global-batch-size", "8",
                                                "--tokens-per-global-batch", "4096"])
    assert "not allowed with argument" in err
    assert "--global-batch-size must be > 0" in parse_or_exit_message(
        capsys, "gpt", ["--global-batch-size", "0"])


def test_global_batch_size_makes_the_sampler_take_that_many_samples(tmp_path):
    from megatron.data.sampler import GlobalBatchSampler
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 256, size=500)
    cfg = parse_args("gpt", BASE + ["--global-batch-size", "12", "--seq-length", "256"],
                     has_cuda=False)
    sampler = GlobalBatchSampler(lengths, rng.integers(0, 3, size=500),
                                 cfg.tokens_per_global_batch,
                                 max_samples_per_batch=cfg.global_batch_size)
    assert [len(sampler.batch(i)) for i in range(50)] == [12] * 50


def test_help_shows_each_model_its_own_flags_and_the_batch_rule(capsys):
    def help_text(model):
        with pytest.raises(SystemExit):
            parse_args(model, ["--help"], has_cuda=False)
        return " ".join(capsys.readouterr().out.split())
    gpt, t5 = help_text("gpt"), help_text("t5")
    for t5_flag in ("--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length",
                    "--decoder-seq-length"):
        assert t5_flag not in gpt and t5_flag in t5
    for text in (gpt, t5):
        assert "--global-batch-size" in text and "give one, not both" in text
        assert "inverse-square-root" in text and "--debug" in text


def test_lr_decay_styles_follow_megatron():
    from megatron.training.optimizer import learning_rate
    cfg = parse_args("gpt", BASE + ["--lr-decay-style", "inverse-square-root"], has_cuda=False)
    assert cfg.lr_decay_style == "inverse-square-root"
    lrs = [learning_rate(i, 1.0, 0.1, 4, 100, "inverse-square-root") for i in range(400)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[15] == pytest.approx((4 / 16) ** 0.5) and lrs[99] == pytest.approx(0.2)
    assert lrs[399] == 0.1   # floored at min_lr, no end of the decay
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert learning_rate(0, 1.0, 0.0, 0, 10, "inverse-square-root") == 1.0
    assert learning_rate(3, 1.0, 0.0, 0, 10, "inverse-square-root") == pytest.approx(0.5)


def test_tensorboard_dir_says_how_to_get_tensorboard(capsys, tmp_path):
    import importlib.util
    argv = ["--tensorboard-dir", str(tmp_path / "tb")]
    if importlib.util.find_spec("tensorboard") is not None:
        assert parse_args("gpt", BASE + argv, has_cuda=False).tensorboard_dir == argv[1]
        return
    err = parse_or_exit_message(capsys, "gpt", argv)
    assert "tensorboard package is not installed" in err and "pip install tensorboard" in err


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_help_lists_the_dropout_wsd_and_mixing_flags(capsys, model):
    with pytest.raises(SystemExit):
        parse_args(model, ["--help"], has_cuda=False)
    text = " ".join(capsys.readouterr().out.split())
    for flag_name in ("--hidden-dropout", "--attention-dropout", "--lr-wsd-decay-iters",
                      "--lr-wsd-decay-style", "--mixing-cap", "--mixing-temperature",
                      "--global-batch-size", "--tokens-per-global-batch"):
        assert flag_name in text, flag_name
    assert "inverse-square-root,WSD" in text and "minus_sqrt" in text
    assert "Megatron's default 0.1" in text


def test_dropout_flags_reach_the_config_and_are_checked(capsys):
    cfg = parse_args("t5", BASE + ["--hidden-dropout", "0.2", "--attention-dropout", "0"],
                     has_cuda=False)
    assert (cfg.hidden_dropout, cfg.attention_dropout) == (0.2, 0.0)
    default = parse_args("gpt", BASE, has_cuda=False)
    assert (default.hidden_dropout, default.attention_dropout) == (0.1, 0.1)
    err = parse_or_exit_message(capsys, "gpt", ["--hidden-dropout", "1", "--attention-dropout",
                                                "-0.1"])
    assert "--hidden-dropout must lie in [0, 1), got 1.0" in err
    assert "--attention-dropout must lie in [0, 1), got -0.1" in err


def test_t5_v11_layer_options_reach_the_model_spec():
    from megatron.training.training import model_spec
    cfg = parse_args("t5", BASE + ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
                                   "--disable-bias-linear", "--gated-gelu", "--softmax-scale",
                                   "1.0", "--kv-channels", "64", "--position-embedding-type",
                                   "relative", "--relative-attention-num-buckets", "16",
                                   "--relative-attention-max-distance", "64",
                                   "--untie-embeddings-and-output-weights"])
    spec = model_spec(cfg, 1000)
    assert (spec.normalization, spec.layernorm_epsilon, spec.add_bias_linear,
            spec.gated_linear_unit, spec.softmax_scale, spec.kv_channels,
            spec.position_embedding_type, spec.relative_attention_num_buckets,
            spec.relative_attention_max_distance, spec.tied_embeddings) == (
        "RMSNorm", 1e-6, False, True, 1.0, 64, "relative", 16, 64, False)
    plain = model_spec(parse_args("gpt", BASE), 1000)
    assert (plain.normalization, plain.add_bias_linear, plain.gated_linear_unit,
            plain.position_embedding_type) == ("LayerNorm", True, False, "learned_absolute")


def test_relative_positions_on_gpt_are_rejected(capsys):
    err = parse_or_exit_message(capsys, "gpt", ["--position-embedding-type", "relative"])
    assert "--position-embedding-type relative is a T5 option" in err


def test_cost_model_defaults_to_a_profile_on_gpu_only(monkeypatch):
    monkeypatch.delenv("DYNAPIPE_DEVICE", raising=False)
    assert parse_args("gpt", BASE, has_cuda=True).cost_model == "profile"
    assert parse_args("gpt", BASE, has_cuda=False).cost_model == "analytic"
    monkeypatch.setenv("DYNAPIPE_DEVICE", "cpu")       # a GPU host forced onto CPU
    assert parse_args("gpt", BASE, has_cuda=True).cost_model == "analytic"
    assert parse_args("gpt", BASE + ["--cost-model", "analytic"],
                      has_cuda=True).cost_model == "analytic"


@pytest.mark.parametrize("model", ["gpt", "t5"])
@pytest.mark.parametrize("algorithm", ["nextfit", "spfhp", "spfhp-grouped", "lpfhp", "nnlshp"])
def test_every_packer_and_the_pack_depth_reach_the_planner(model, algorithm):
    from megatron.training.training import planner_config, model_spec
    cfg = parse_args(model, BASE + ["--micro-batching", "packing", "--packing-algorithm",
                                    algorithm, "--max-pack-depth", "5"], has_cuda=False)
    assert (cfg.packing_algorithm, cfg.max_pack_depth, cfg.packing_window) == (algorithm, 5, 0)
    planner = planner_config(cfg, model_spec(cfg, 1000), 1).planner
    assert (planner.packing_algorithm, planner.max_pack_depth) == (algorithm, 5)
    assert parse_args(model, BASE, has_cuda=False).max_pack_depth is None


@pytest.mark.parametrize("strategy, given, planned", [
    ("padding", None, 4), ("padding", 3, 3),      # padding: 4 rows unless told
    ("packing", None, None), ("packing", 3, 3),   # packing: searched per batch unless told
    ("dynamic", None, None), ("dynamic", 3, None)])   # dynamic sizes its own
def test_micro_batch_size_fixes_the_rows_of_padding_and_packing(strategy, given, planned,
                                                                capsys):
    from megatron.training.training import model_spec, planner_config
    argv = BASE + ["--micro-batching", strategy]
    cfg = parse_args("gpt", argv + ([] if given is None else ["--micro-batch-size", str(given)]),
                     has_cuda=False)
    assert cfg.micro_batch_size == given
    assert planner_config(cfg, model_spec(cfg, 1000), 1).planner.micro_batch_size == planned
    assert "--micro-batch-size must be > 0, got 0" in parse_or_exit_message(
        capsys, "gpt", ["--micro-batching", strategy, "--micro-batch-size", "0"])


def test_packing_window_flags_make_the_sampler_pack_and_the_planner_rebuild(capsys):
    from megatron.training.training import (model_spec, packing_window, planner_config,
                                            replica_split, sampler_settings)
    cfg = parse_args("t5", BASE + ["--micro-batching", "packing", "--packing-algorithm",
                                   "lpfhp", "--packing-window", "50000", "--encoder-seq-length",
                                   "512", "--decoder-seq-length", "128",
                                   "--tokens-per-global-batch", "8192"], has_cuda=False)
    window = packing_window(cfg)
    assert (window.samples, window.algorithm, window.row_lengths, window.max_depth) == \
        (50000, "lpfhp", (512, 128), None)
    # the sampler packed the rows; the planner's next-fit rebuilds them from its order
    assert planner_config(cfg, model_spec(cfg, 1000), 1).planner.packing_algorithm == "nextfit"
    assert replica_split(cfg) == "micro-batches"
    settings = sampler_settings(cfg)
    assert (settings["--packing-window"], settings["--packing-algorithm"]) == (50000, "lpfhp")
    plain = parse_args("gpt", BASE + ["--micro-batching", "packing"], has_cuda=False)
    assert packing_window(plain) is None and sampler_settings(plain)["--packing-window"] is None
    for argv, message in (
            (["--packing-window", "100"], "--packing-window packs rows for --micro-batching "
                                          "packing, not dynamic"),
            (["--micro-batching", "packing", "--packing-window", "100", "--global-batch-size",
              "8"], "give --tokens-per-global-batch, not --global-batch-size"),
            (["--micro-batching", "packing", "--packing-window", "100", "--replica-split",
              "samples"], "needs --replica-split micro-batches"),
            (["--micro-batching", "packing", "--packing-window", "100", "--seq-length", "2048",
              "--tokens-per-global-batch", "2048", "--max-position-embeddings", "2048"], None),
            (["--micro-batching", "packing", "--packing-window", "-1"],
             "--packing-window must be >= 0"),
            (["--micro-batching", "packing", "--max-pack-depth", "0"],
             "--max-pack-depth must be >= 1, got 0")):
        if message is None:
            assert parse_args("gpt", BASE + argv, has_cuda=False).packing_window == 100
            continue
        assert message in " ".join(parse_or_exit_message(capsys, "gpt", argv).split())
    t5_err = parse_or_exit_message(capsys, "t5", ["--micro-batching", "packing",
                                                  "--packing-window", "100",
                                                  "--encoder-seq-length", "512",
                                                  "--decoder-seq-length", "128",
                                                  "--tokens-per-global-batch", "600"])
    assert "cannot hold one packed row of 640 tokens (--packing-window)" in t5_err


def test_wave_and_interleaved_flags_set_the_stage_count(capsys):
    from megatron.training.arguments import pipeline_stage_count, virtual_stages
    pp2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "8"]
    cfg = parse_args("gpt", BASE + pp2 + ["--pipeline-schedule", "wave", "--pipeline-waves", "2"],
                     has_cuda=False)
    assert cfg.pipeline_waves == 2 and pipeline_stage_count(cfg) == 8
    cfg = parse_args("gpt", BASE + pp2 + ["--pipeline-schedule", "interleaved",
                                          "--num-virtual-stages-per-pipeline-rank", "4"],
                     has_cuda=False)
    assert virtual_stages(cfg) == 4 and pipeline_stage_count(cfg) == 8
    cfg = parse_args("gpt", BASE + pp2 + ["--pipeline-schedule", "interleaved",
                                          "--num-layers-per-virtual-pipeline-stage", "1"],
                     has_cuda=False)
    assert virtual_stages(cfg) == 4      # Megatron's spelling: 8 layers / (2 ranks x 1)
    cfg = parse_args("gpt", BASE + pp2 + ["--pipeline-schedule", "interleaved"], has_cuda=False)
    assert virtual_stages(cfg) == 2 and pipeline_stage_count(cfg) == 4
    err = parse_or_exit_message(capsys, "gpt", pp2 + ["--pipeline-schedule", "interleaved",
                                                      "--num-layers-per-virtual-pipeline-stage",
                                                      "3"])
    assert "--num-layers-per-virtual-pipeline-stage 3: 8 layers are not a whole number" in err
    err = parse_or_exit_message(capsys, "gpt", ["--pipeline-model-parallel-size", "2",
                                                "--pipeline-schedule", "wave",
                                                "--pipeline-waves", "2"])
    assert ("--pipeline-schedule wave with --pipeline-waves 2 cuts the model into 8 stages"
            in err and "4 transformer layers do not split evenly over 8 pipeline stages" in err)
    err = parse_or_exit_message(capsys, "t5", ["--pipeline-model-parallel-size", "2",
                                               "--num-layers", "1", "--pipeline-schedule",
                                               "interleaved"])
    assert "T5 stages hold whole layers" in err


def test_every_declared_schedule_is_a_flag_value_cut_on_its_layout(capsys):
    """--pipeline-schedule takes each schedule of the registry, cuts the model into the
    stages of the layout it is declared on, and its help carries the schedule's summary."""
    from megatron.training.arguments import pipeline_stage_count
    from dynapipe_ext.schedule.registry import SCHEDULES, layout_stages
    pp2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "8"]
    for decl in SCHEDULES.values():
        cfg = parse_args("gpt", BASE + pp2 + ["--pipeline-schedule", decl.name], has_cuda=False)
        assert pipeline_stage_count(cfg) == len(layout_stages(decl.home_layout, 2))
    with pytest.raises(SystemExit):
        parse_args("gpt", BASE + ["--help"], has_cuda=False)
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f"{d.name}: {d.summary}" in help_text for d in SCHEDULES.values())
    assert "invalid choice: 'zigzag'" in parse_or_exit_message(
        capsys, "gpt", BASE + ["--pipeline-schedule", "zigzag"])


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_measured_schedule_bench_runs_each_schedule_on_its_stage_count(model, tmp_path):
    """tools/bench_pipeline_training.py: PP=2 with 2 stages (1f1b, adaptive, auto's default)
    and 4 virtual stages (interleaved v=2, wave W=1) of the same 4-layer model."""
    from megatron.training.arguments import pipeline_stage_count
    from megatron.bench.schedule_bench import SCHEDULES, run_argv
    tokenizer = tmp_path / "sp.model"      # the quickstart's data need not exist to parse
    tokenizer.write_bytes(b"")

    def argv(name):
        return [str(tokenizer) if a.endswith("sp.model") else a
                for a in run_argv(model, name, 3, "s.jsonl")]
    stages = {name: pipeline_stage_count(parse_args(model, argv(name), has_cuda=False))
              for name in SCHEDULES}
    assert stages == {"1f1b": 2, "adaptive": 2, "interleaved v=2": 4, "wave W=1": 4, "auto": 2}


def test_group_query_attention_reaches_the_model_spec_and_megatron_core_config():
    """pretrain_gpt.py --group-query-attention --num-query-groups 2: the config, the planner's
    ModelSpec and the megatron-core TransformerConfig the stages are built from all have 2
    query groups; without the flag every head is its own group (and the ModelSpec is the
    one of before), and --group-query-attention alone is Megatron's default of 1 group."""
    from megatron.model.stages import build_transformer_config
    from megatron.training.training import model_spec
    cfg = parse_args("gpt", BASE + ["--group-query-attention", "--num-query-groups", "2",
                                    "--tensor-model-parallel-size", "2"], has_cuda=False)
    assert cfg.group_query_attention and cfg.num_query_groups == 2
    spec = model_spec(cfg, 1000)
    assert spec.num_query_groups == 2 and spec.query_groups == 2
    config = build_transformer_config(spec, tp=2, fused=False)
    assert (config.num_attention_heads, config.num_query_groups) == (4, 2)
    plain = parse_args("gpt", BASE, has_cuda=False)
    assert not plain.group_query_attention and plain.num_query_groups == 4
    assert model_spec(plain, 1000).num_query_groups == 0       # the spec of before: MHA
    assert build_transformer_config(model_spec(plain, 1000), fused=False).num_query_groups == 4
    mqa = parse_args("gpt", BASE + ["--group-query-attention"], has_cuda=False)
    assert mqa.num_query_groups == 1


@pytest.mark.parametrize("argv, message", [
    (["--num-query-groups", "2"], "--num-query-groups 2 needs --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-query-groups 3 must be > 0 and divide --num-attention-heads 4"),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size",
      "4"], "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--group-query-attention", "--tensor-model-parallel-size", "2"],   # default: 1 group
     "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups must be > 0"),
])
def test_bad_query_group_combinations_are_errors_naming_the_flags(capsys, argv, message):
    assert message in parse_or_exit_message(capsys, "gpt", argv)


def test_group_query_attention_on_t5_is_refused_in_one_line(capsys):
    err = parse_or_exit_message(capsys, "t5", ["--group-query-attention", "--num-query-groups",
                                               "2"])
    assert ("--group-query-attention is GPT only: megatron-core's T5 cross-attention does not "
            "support grouped-query attention") in err
    assert err.count("\n") == 1


def test_hf_tokenizer_needs_a_directory_and_a_decoder_model(capsys, tmp_path):
    hf = ["--tokenizer-type", "HuggingFaceTokenizer"]
    assert "needs --tokenizer-model" in parse_or_exit_message(capsys, "gpt", hf)
    file = tmp_path / "tokenizer.json"
    file.write_text("{}")
    err = parse_or_exit_message(capsys, "gpt", hf + ["--tokenizer-model", str(file)])
    assert f"--tokenizer-model {file}: no such directory" in err
    err = parse_or_exit_message(capsys, "t5", hf + ["--tokenizer-model", str(tmp_path)])
    assert "HuggingFaceTokenizer is for decoder models" in err
    cfg = parse_args("gpt", BASE + hf + ["--tokenizer-model", str(tmp_path)], has_cuda=False)
    assert cfg.tokenizer_model == str(tmp_path)
