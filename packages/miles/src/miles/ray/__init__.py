"""Ray-facing pieces of miles core: the train-actor contract every training backend implements.

Example, a backend's actor class::

    from miles.ray import TrainRayActor

    class MyTrainActor(TrainRayActor):
        def init(self, args, role, with_ref):
            self.setup_distributed()  # rank 0 is the master
            ...
            return 0  # the rollout id to start from

Nothing here imports Ray or a backend: the train loop wraps these classes in Ray actors.
"""

from miles.ray.train_actor import ROLES, Role, TrainRayActor

__all__ = ["ROLES", "Role", "TrainRayActor"]
