"""Train a GPT model on multi-task data with variable-size micro-batches (DynaPipe) on
megatron-core: `torchrun --nproc-per-node N pretrain_gpt.py --data-path PREFIX ...`
(see --help and README.md)."""


def main(argv=None) -> int:
    # Imported here, not at the top: planner workers are spawned processes that re-import this
    # file, and they need none of torch / megatron-core.
    from megatron.training.pretrain import pretrain
    return pretrain("gpt", argv)


if __name__ == "__main__":
    status = main()
    from megatron.base.distributed_setup import end_process
    end_process(status)
