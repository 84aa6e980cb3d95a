"""The CPU test suite runs on CPU and gloo even on a GPU host (distributed_setup.use_cuda honours
DYNAPIPE_DEVICE; subprocesses and torchrun runs inherit it). The GPU suite (tests/integration/test_gpu.py,
`pytest -m gpu`) asks for CUDA explicitly."""
import os

os.environ["DYNAPIPE_DEVICE"] = "cpu"
