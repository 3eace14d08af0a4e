"""The weight-sync wire protocol shared by every trainer backend and engine.

(architecture.md: "Contracts / Weight sync")

Trainers hand over `(name, tensor)` pairs of full parameters; a sender buckets them (bounded by
`--update-weight-buffer-size`), casts them to the engine dtype and ships them through shared
memory / CUDA IPC (colocated) or a broadcast group (disaggregated). Engines receive with the
matching `deserialize_*` / `receive_tensors` and copy into their model with `load_named_tensors`::

    sender = TensorWeightSender(clients, max_bytes=512 << 20, dtype=torch.bfloat16)
    sender.send(model.state_dict().items(), weight_version="3")

A LoRA run syncs its adapter instead (`make_lora_adapter_updater`): rank 0 writes it as a PEFT
directory the engines read, and swaps it in with /unload_lora_adapter and /load_lora_adapter.
"""

from miles.backends.sglang_utils.weight_sync.buckets import (
    FlattenedBucket,
    TensorMeta,
    dtype_from_name,
    dtype_name,
    flatten_bucket,
    iter_buckets,
    iter_buckets_with_last,
    unflatten_bucket,
)
from miles.backends.sglang_utils.weight_sync.distributed_transport import (
    DISTRIBUTED_LOAD_FORMATS,
    FLATTENED_BUCKET,
    ReceiveBuffer,
    WeightUpdateGroup,
    broadcast_tensors,
    create_weight_update_group,
    flattened_dtype,
    receive_flattened,
    receive_tensors,
)
from miles.backends.sglang_utils.weight_sync.loader import WeightUpdateError, load_named_tensors
from miles.backends.sglang_utils.weight_sync.lora_updater import (
    UpdateLoraAdapter,
    make_lora_adapter_updater,
)
from miles.backends.sglang_utils.weight_sync.senders import (
    DistributedWeightSender,
    TensorWeightSender,
    WeightSyncClient,
    WeightSyncError,
)
from miles.backends.sglang_utils.weight_sync.tensor_transport import (
    deserialize_flattened_bucket,
    deserialize_named_tensors,
    serialize_flattened_bucket,
    serialize_named_tensors,
    share_tensor,
)
from miles.backends.sglang_utils.weight_sync.updaters import (
    UpdateWeightFromDistributed,
    UpdateWeightFromTensor,
    WeightUpdater,
    distributed_load_format,
    engine_urls_for_rank,
    make_weight_updater,
)

__all__ = [
    "DISTRIBUTED_LOAD_FORMATS",
    "FLATTENED_BUCKET",
    "DistributedWeightSender",
    "FlattenedBucket",
    "ReceiveBuffer",
    "TensorMeta",
    "TensorWeightSender",
    "UpdateLoraAdapter",
    "UpdateWeightFromDistributed",
    "UpdateWeightFromTensor",
    "WeightSyncClient",
    "WeightSyncError",
    "WeightUpdateError",
    "WeightUpdateGroup",
    "WeightUpdater",
    "broadcast_tensors",
    "create_weight_update_group",
    "deserialize_flattened_bucket",
    "deserialize_named_tensors",
    "distributed_load_format",
    "dtype_from_name",
    "dtype_name",
    "engine_urls_for_rank",
    "flatten_bucket",
    "flattened_dtype",
    "iter_buckets",
    "iter_buckets_with_last",
    "load_named_tensors",
    "make_lora_adapter_updater",
    "make_weight_updater",
    "receive_flattened",
    "receive_tensors",
    "serialize_flattened_bucket",
    "serialize_named_tensors",
    "share_tensor",
    "unflatten_bucket",
]
