"""Addresses for the processes of one engine to find each other.

Mirrors vllm/utils/network_utils.py (``get_ip``, ``get_loopback_ip``,
``get_open_port``, ``get_distributed_init_method``,
``get_open_zmq_ipc_path``). Departure: an ``ipc://`` path here is in
Linux's abstract socket namespace (``ipc://@name``), which leaves no socket
file behind whoever dies; elsewhere it is a TCP port on the loopback.
"""

from __future__ import annotations

import socket
import sys
import uuid


def get_loopback_ip() -> str:
    return "127.0.0.1"


def get_ip() -> str:
    """This machine's address as other machines see it (the loopback if none);
    ``TRACEVLLM_HOST_IP`` wins (vLLM's ``VLLM_HOST_IP``)."""
    from tracevllm import envs

    if host_ip := envs.TRACEVLLM_HOST_IP:
        return host_ip
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            # No packet is sent: connect() on UDP only picks the outgoing interface.
            s.connect(("8.8.8.8", 80))
            return str(s.getsockname()[0])
        except OSError:
            return get_loopback_ip()


def get_open_port() -> int:
    """A TCP port nothing listens on now (it could be taken before it is used)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def get_distributed_init_method(ip: str, port: int) -> str:
    """torch.distributed's rendezvous address."""
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def get_open_zmq_ipc_path() -> str:
    """A fresh ZeroMQ address on this machine, that leaves no file behind."""
    if sys.platform.startswith("linux"):
        return f"ipc://@tracevllm-{uuid.uuid4().hex}"
    return f"tcp://{get_loopback_ip()}:{get_open_port()}"
