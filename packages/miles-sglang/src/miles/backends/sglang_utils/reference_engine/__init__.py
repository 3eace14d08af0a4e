"""The reference engine: SGLang's native HTTP API served by PyTorch + transformers.

It is what runs on CPU, in tests and wherever SGLang is not installed. Start one with::

    miles-reference-engine --model-path /path/to/checkpoint --port 30000
"""

from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig
from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine
from miles.backends.sglang_utils.reference_engine.server import create_app

__all__ = ["ReferenceEngine", "ReferenceEngineConfig", "create_app"]
