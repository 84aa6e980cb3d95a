"""The flags are declared once (megatron/training/arguments.py FLAGS, with the choice lists
of the code that owns them), the parsers are generated from them, and docs/FLAGS.md is what
the generator writes."""
import argparse
import ast
import collections
import dataclasses
import pathlib
import re

import pytest

from megatron.training import arguments
from megatron.training.arguments import FLAGS, TrainConfig, build_parser, flags_markdown

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = [p for d in ("megatron", "dynapipe_ext") for p in sorted((ROOT / d).rglob("*.py"))]
# a flag declared by name: add_argument("--x", declare(GROUP, "--x", or (("--x", ...), ...)
DECLARED = re.compile(r'(?:add_argument\(\s*|declare\(\w+,\s*|\(\()"(--[\w-]+)"')

# The trainers' flags before they were generated from declarations:
# option strings -> (default, choices, type, nargs, required); the same for GPT and T5.
PARSER_BEFORE = {
    "--adam-beta1": (0.9, None, 'float', None, False),
    "--adam-beta2": (0.999, None, 'float', None, False),
    "--adam-eps": (1e-08, None, 'float', None, False),
    "--attention-dropout": (0.1, None, 'float', None, False),
    "--bf16": (False, None, 'None', 0, False),
    "--check-plans": (False, None, 'None', 0, False),
    "--clip-grad": (1.0, None, 'float', None, False),
    "--use-distributed-optimizer": (False, None, 'None', 0, False),
    "--overlap-param-gather": (False, None, 'None', 0, False),
    "--ddp-bucket-size": (None, None, 'int', None, False),
    "--cost-model": (None, None, 'None', None, False),
    "--cost-model-cache-dir": (None, None, 'None', None, False),
    "--data-path": (None, None, 'None', '+', True),
    "--debug": (False, None, 'None', 0, False),
    "--decoder-num-layers": (None, None, 'int', None, False),
    "--decoder-seq-length": (None, None, 'int', None, False),
    "--device-flops": (None, None, 'float', None, False),
    "--device-memory-gb": (None, None, 'float', None, False),
    "--disable-bias-linear": (False, None, 'None', 0, False),
    "--distributed-timeout-minutes": (None, None, 'float', None, False),
    "--dynamic-layout": ('packed', ('packed', 'padded'), 'None', None, False),
    "--encoder-num-layers": (None, None, 'int', None, False),
    "--encoder-seq-length": (None, None, 'int', None, False),
    "--eval-interval": (0, None, 'int', None, False),
    "--eval-iters": (100, None, 'int', None, False),
    "--ffn-hidden-size": (None, None, 'int', None, False),
    "--exit-signal-handler|--no-exit-signal-handler": (True, None, 'None', 0, False),
    "--finetune": (False, None, 'None', 0, False),
    "--flextp-accuracy-weight": (1.0, None, 'float', None, False),
    "--flextp-ffn-unit": (0, None, 'int', None, False),
    "--flextp-initial-speeds": (None, None, 'None', None, False),
    "--flextp-interval": (10, None, 'int', None, False),
    "--flextp-max-drop-fraction": (0.375, None, 'float', None, False),
    "--flextp-min-horizon": (20, None, 'int', None, False),
    "--flextp-patience": (6, None, 'int', None, False),
    "--fp16": (False, None, 'None', 0, False),
    "--gated-gelu": (False, None, 'None', 0, False),
    "--global-batch-size": (None, None, 'int', None, False),
    "--group-query-attention": (False, None, 'None', 0, False),
    "--hidden-dropout": (0.1, None, 'float', None, False),
    "--hidden-size": (None, None, 'int', None, True),
    "--keep-last": (0, None, 'int', None, False),
    "--kv-channels": (None, None, 'int', None, False),
    "--load": (None, None, 'None', None, False),
    "--log-interval": (1, None, 'int', None, False),
    "--lr": (0.001, None, 'float', None, False),
    "--lr-decay-iters": (None, None, 'int', None, False),
    "--lr-decay-style":
        ('cosine', ('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD'), 'None', None, False),
    "--lr-warmup-iters": (0, None, 'int', None, False),
    "--lr-wsd-decay-iters": (None, None, 'int', None, False),
    "--lr-wsd-decay-style":
        ('exponential', ('exponential', 'linear', 'cosine', 'minus_sqrt'), 'None', None, False),
    "--make-vocab-size-divisible-by": (128, None, 'int', None, False),
    "--max-pack-depth": (None, None, 'int', None, False),
    "--max-position-embeddings": (None, None, 'int', None, False),
    "--memory-headroom-gb": (None, None, 'float', None, False),
    "--merge-file": (None, None, 'None', None, False),
    "--micro-batch-size": (None, None, 'int', None, False),
    "--micro-batching":
        ('dynamic', ('padding', 'token-budget', 'packing', 'dynamic'), 'None', None, False),
    "--min-lr": (0.0, None, 'float', None, False),
    "--mixing-cap": (None, None, 'int', None, False),
    "--mixing-temperature": (1.0, None, 'float', None, False),
    "--no-bias-dropout-fusion": (True, None, 'None', 0, False),
    "--no-bias-gelu-fusion": (True, None, 'None', 0, False),
    "--no-load-optim": (False, None, 'None', 0, False),
    "--no-load-rng": (False, None, 'None', 0, False),
    "--norm-epsilon": (1e-05, None, 'float', None, False),
    "--normalization": ('LayerNorm', ('LayerNorm', 'RMSNorm'), 'None', None, False),
    "--num-attention-heads": (None, None, 'int', None, True),
    "--num-layers": (None, None, 'int', None, False),
    "--num-layers-per-virtual-pipeline-stage": (None, None, 'int', None, False),
    "--num-planner-workers": (1, None, 'planner_workers', None, False),
    "--num-query-groups": (None, None, 'int', None, False),
    "--num-virtual-stages-per-pipeline-rank": (None, None, 'int', None, False),
    "--override-opt-param-scheduler|--override-opt_param-scheduler":
        (False, None, 'None', 0, False),
    "--p2p-bandwidth-gbps": (None, None, 'float', None, False),
    "--p2p-latency-us": (None, None, 'float', None, False),
    "--override-data-identity": (False, None, 'None', 0, False),
    "--overwrite-checkpoints": (False, None, 'None', 0, False),
    "--packing-algorithm":
        ('spfhp', ('nextfit', 'spfhp', 'spfhp-grouped', 'lpfhp', 'nnlshp'), 'None', None, False),
    "--packing-window": (0, None, 'int', None, False),
    "--pipeline-model-parallel-size": (1, None, 'int', None, False),
    "--pipeline-schedule":
        ('auto', ('auto', '1f1b', 'adaptive', 'interleaved', 'wave'), 'None', None, False),
    "--pipeline-split": ('even', None, 'None', None, False),
    "--pipeline-waves": (1, None, 'int', None, False),
    "--plan-prefetch": (2, None, 'int', None, False),
    "--position-embedding-type":
        ('learned_absolute', ('learned_absolute', 'relative', 'rope'), 'None', None, False),
    "--profile": (False, None, 'None', 0, False),
    "--profile-dir": (None, None, 'None', None, False),
    "--profile-ranks": ([0], None, 'int', '+', False),
    "--profile-step-end": (12, None, 'int', None, False),
    "--profile-step-start": (10, None, 'int', None, False),
    "--relative-attention-max-distance": (128, None, 'int', None, False),
    "--relative-attention-num-buckets": (32, None, 'int', None, False),
    "--replica-split": ('auto', ('micro-batches', 'samples', 'auto'), 'None', None, False),
    "--save": (None, None, 'None', None, False),
    "--save-interval": (0, None, 'int', None, False),
    "--seed": (1234, None, 'int', None, False),
    "--seq-length": (None, None, 'int', None, False),
    "--softmax-scale": (None, None, 'float', None, False),
    "--split": (None, None, 'None', None, False),
    "--stats-file": (None, None, 'None', None, False),
    "--tensor-model-parallel-size": (1, None, 'int', None, False),
    "--tensorboard-dir": (None, None, 'None', None, False),
    "--tokenizer-model": (None, None, 'None', None, False),
    "--tokenizer-type":
        ('GPT2BPETokenizer', ('GPT2BPETokenizer', 'SentencePieceTokenizer', 'T5SentencePieceTokenizer',
                              'HuggingFaceTokenizer'), 'None', None, False),
    "--tokens-per-global-batch": (None, None, 'int', None, False),
    "--tp-balance": ('off', ('off', 'resize', 'migrate', 'semi'), 'None', None, False),
    "--tp-balance-max-share": (1.5, None, 'float', None, False),
    "--flextp-skip-order": ('rotate', ('rotate', 'sticky'), 'None', None, False),
    "--train-iters": (None, None, 'int', None, True),
    "--untie-embeddings-and-output-weights": (False, None, 'None', 0, False),
    "--use-checkpoint-opt-param-scheduler|--use-checkpoint-opt_param-scheduler":
        (False, None, 'None', 0, False),
    "--valid-data-path": (None, None, 'None', '+', False),
    "--vocab-extra-ids": (None, None, 'int', None, False),
    "--vocab-file": (None, None, 'None', None, False),
    "--weight-decay": (0.01, None, 'float', None, False),
    # the decoder models of today (Llama, Qwen, Mistral)
    "--add-qkv-bias": (False, None, 'None', 0, False),
    "--swiglu": (False, None, 'None', 0, False),
    "--rotary-base": (10000.0, None, 'float', None, False),
    "--rotary-percent": (1.0, None, 'float', None, False),
    "--use-rope-scaling": (False, None, 'None', 0, False),
    "--rope-scaling-factor": (8.0, None, 'float', None, False),
    "--rope-scaling-low-freq-factor": (1.0, None, 'float', None, False),
    "--rope-scaling-high-freq-factor": (4.0, None, 'float', None, False),
    "--rope-scaling-original-max-position-embeddings": (8192, None, 'int', None, False),
    "--attention-backend": ('auto', ('auto', 'flex', 'sdpa', 'dense-mask'), 'None', None, False),
}
T5_ONLY = {"--decoder-num-layers", "--decoder-seq-length", "--encoder-num-layers",
           "--encoder-seq-length", "--relative-attention-max-distance",
           "--relative-attention-num-buckets"}
GPT_ONLY = {"--rotary-base", "--rotary-percent", "--use-rope-scaling", "--rope-scaling-factor",
            "--rope-scaling-low-freq-factor", "--rope-scaling-high-freq-factor",
            "--rope-scaling-original-max-position-embeddings"}
EXCLUSIVE = [{"--global-batch-size", "--tokens-per-global-batch"},
             {"--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"}]


def declarations_by_flag(paths) -> dict[str, list[str]]:
    found = collections.defaultdict(list)
    for path in paths:
        for match in DECLARED.finditer(path.read_text()):
            found[match.group(1)].append(str(path.relative_to(ROOT)))
    return found


def test_every_flag_is_declared_once_in_the_library():
    twice = {flag: where for flag, where in declarations_by_flag(LIBRARY).items()
             if len(where) > 1}
    assert not twice, f"flags declared more than once: {twice}"
    names = [name for f in FLAGS for name in f.names]
    assert len(names) == len(set(names))


def test_tools_take_model_and_parallel_flags_from_the_declarations():
    shared = {name for f in FLAGS if f.group in ("model", "parallel") for name in f.names}
    tools = sorted((ROOT / "tools").glob("**/*.py"))
    own = {flag: where for flag, where in declarations_by_flag(tools).items() if flag in shared}
    assert not own, f"tools declare trainer flags themselves (use add_flag_group): {own}"


def test_config_fields_have_no_defaults_of_their_own():
    """A field's default is its flag's (or resolved_fields'), never a second copy."""
    with_default = [f.name for f in dataclasses.fields(TrainConfig)
                    if f.default is not dataclasses.MISSING
                    or f.default_factory is not dataclasses.MISSING]
    assert not with_default
    filled = {f.field_name for f in FLAGS if f.field_name} | {"model"}
    resolved = {"num_layers", "decoder_num_layers", "seq_length", "decoder_seq_length",
                "ffn_hidden_size", "max_position_embeddings", "kv_channels", "num_query_groups",
                "distributed_timeout_minutes", "tokens_per_global_batch", "global_batch_size",
                "num_virtual_stages_per_pipeline_rank", "cost_model", "attention_backend",
                "lr_decay_iters",
                "lr_wsd_decay_iters"}
    assert filled | resolved == {f.name for f in dataclasses.fields(TrainConfig)}
    assert not filled & resolved


def string_tuples(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Tuple) and len(node.elts) >= 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            yield tuple(e.value for e in node.elts)


def test_choice_lists_are_written_down_once():
    literals = collections.Counter(t for path in LIBRARY for t in string_tuples(path))
    for f in FLAGS:
        if f.choices:
            owned = tuple(c for c in f.choices if c != "auto") if f.dest == "replica_split" \
                else tuple(f.choices)
            assert literals[owned] <= 1, f"{f.name}: its choices are written out " \
                                         f"{literals[owned]} times"
    from dynapipe_ext.batching.planners import STRATEGIES
    from dynapipe_ext.plan import iteration_planner
    assert arguments.MICRO_BATCHING == tuple(STRATEGIES)
    assert arguments.PIPELINE_SCHEDULES is iteration_planner.PIPELINE_SCHEDULES
    assert arguments.REPLICA_SPLITS is iteration_planner.REPLICA_SPLITS
    source = (ROOT / "megatron/training/arguments.py").read_text()
    assert not re.search(r"^(MICRO_BATCHING|PIPELINE_SCHEDULES) = \(", source, re.M)


def test_flags_doc_is_what_the_generator_writes():
    written = (ROOT / "docs" / "FLAGS.md").read_text()
    assert written == flags_markdown(), \
        "docs/FLAGS.md is stale: python -m megatron.training.arguments --write-flags-doc"


def parser_flags(model: str) -> dict:
    parser = build_parser(model)
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        kind = getattr(action.type, "__name__", repr(action.type))
        out["|".join(action.option_strings)] = (
            action.default, tuple(action.choices) if action.choices else None, kind,
            action.nargs, action.required)
    return out


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_generated_parser_takes_the_flags_it_took_before(model):
    assert parser_flags(model) == PARSER_BEFORE
    parser = build_parser(model)
    hidden = {a.option_strings[0] for a in parser._actions if a.help == argparse.SUPPRESS}
    assert hidden == (T5_ONLY if model == "gpt" else GPT_ONLY)
    exclusive = [{o for a in g._group_actions for o in a.option_strings}
                 for g in parser._mutually_exclusive_groups]
    assert exclusive == EXCLUSIVE


def test_add_flag_group_gives_a_tool_the_declared_flags_with_its_own_defaults():
    parser = argparse.ArgumentParser()
    arguments.add_flag_group(parser, "model", ["num_layers", "hidden_size"],
                             num_layers=dict(default=4),
                             hidden_size=dict(required=False, default=64, aliases=("--hs",)))
    assert vars(parser.parse_args([])) == {"num_layers": 4, "hidden_size": 64}
    assert parser.parse_args(["--hs", "8"]).hidden_size == 8
    with pytest.raises(KeyError):
        arguments.add_flag_group(argparse.ArgumentParser(), "model", ["train_iters"])
