"""How ranks talk outside torch.distributed's collectives
(vllm/distributed/device_communicators/)."""
