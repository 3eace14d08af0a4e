"""The processes of a run, placed and driven through Ray: the run (`run`), placement groups
(`placement`), the rollout manager and its engine fleet, the train group of train-rank actors.

The contract a training backend implements is not here but in `miles.train_backend` (it imports
no Ray); nor is the placement plan, a pure function of the configuration (`miles.config`).
"""

from miles.backends.training_utils.infra.vendor_libs import disable_unusable_amdsmi

# Every module of this package imports Ray, whose GPU probe inside `import ray` imports amdsmi: an
# amdsmi that cannot load must be set aside first, or no miles process starts.
disable_unusable_amdsmi()
