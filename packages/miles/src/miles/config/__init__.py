"""The configuration of a run: typed groups, YAML + flags, validation and derived values.

from miles.config import load_config
config = load_config(["--hf-checkpoint", "ckpt", "--prompt-data", "train.jsonl",
                      "--rollout-batch-size", "8", "--n-samples-per-prompt", "4"])
config.training.global_batch_size  # 32: derived (one optimizer step per rollout)
"""

from miles.config.loader import build_parser, load_config, read_yaml
from miles.config.miles_config import MilesConfig
from miles.config.registry import CORE_GROUPS, Schema

__all__ = ["CORE_GROUPS", "MilesConfig", "Schema", "build_parser", "load_config", "read_yaml"]
