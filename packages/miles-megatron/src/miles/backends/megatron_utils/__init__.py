"""miles-megatron: the Megatron-core training backend of miles (actor, HF<->Megatron weight
converters, weight senders). It registers as the `megatron` train backend."""

__all__: list[str] = []
