"""miles-sglang: the rollout-engine side of miles.

It speaks SGLang's native HTTP API: a client (`client`), a launcher for real SGLang servers
(`sglang_engine`), the sglang-router wiring (`router`), the weight-sync wire protocol
(`weight_sync`), and a pure-PyTorch reference engine serving the same API (`reference_engine`,
console script `miles-reference-engine`). Example::

    from miles.backends.sglang_utils.client import SyncEngineClient

    with SyncEngineClient("http://127.0.0.1:30000") as engine:
        out = engine.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}})
"""

__all__: list[str] = []
