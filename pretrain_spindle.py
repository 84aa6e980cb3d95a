"""Train a multi-task multi-modal model (FLAN text, image and audio encoders, task heads, a
contrastive image-text head) under a Spindle wave plan:
`torchrun --nproc-per-node N pretrain_spindle.py --data-path PREFIX ...` (see --help and
megatron/spindle/train.py)."""


def main(argv=None) -> int:
    from megatron.spindle.train import train
    train(argv)
    return 0


if __name__ == "__main__":
    status = main()
    from megatron.base.distributed_setup import end_process
    end_process(status)
