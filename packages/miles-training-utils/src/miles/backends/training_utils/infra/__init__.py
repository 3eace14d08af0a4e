"""What the rest of training-utils stands on: the device, this rank's place in the training mesh,
metrics reduced across ranks, and the checks of flags that name user code or checkpoints.

`device` (the only module that branches on the device kind) with `vendor_libs`, `parallel`
(`ParallelState`), `metrics` (cross-rank reductions with the right weights), `import_path`
("pkg.mod:fn" flags) and `checkpoint_paths`. It imports nothing else of training-utils.
"""
