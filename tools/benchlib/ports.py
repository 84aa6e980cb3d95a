"""A free TCP port for a launcher's rendezvous (the library's, on the loopback only)."""
from megatron.base.process_world import free_local_port as free_port  # noqa: F401
