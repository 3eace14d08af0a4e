"""Parameter names of the trained model as Hugging Face checkpoints and engines spell them."""

from __future__ import annotations

# Module wrappers that insert a path component into parameter names: activation checkpointing
# (torch's checkpoint_wrapper) and torch.compile. Engines and HF checkpoints know neither.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_parameter_name(fqn: str) -> str:
    """`fqn` of the trained model with wrapper path components removed: the Hugging Face name."""
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn
