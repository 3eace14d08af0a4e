"""The one RL train step every backend runs, and the contract a backend implements for it.

`train_engine` (`TrainEngine`: the primitives a backend supplies), `trainer` (`PolicyTrainer`: one
rollout's optimizer steps over an engine), `logprobs` (chunked log-probs and entropy from logits,
for the engines' forwards) and `routing_replay` (MoE routing replay in the trainer's forward).
"""
