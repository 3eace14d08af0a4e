"""miles-fsdp: the PyTorch FSDP2 training backend of miles (device meshes, train actor, DCP
checkpoints, weight senders). It registers as the `fsdp` train backend."""

__all__: list[str] = []
