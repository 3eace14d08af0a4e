"""miles-sglang: the rollout-engine side of miles.

It speaks SGLang's native HTTP API: a client, a launcher for real SGLang servers, router wiring,
the weight-sync wire protocol, and a pure-PyTorch reference engine serving the same API.
"""

__all__: list[str] = []
