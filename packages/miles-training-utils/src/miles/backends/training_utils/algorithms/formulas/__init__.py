"""The RL formulas as pure functions over tensors; each cites its paper and has a float64
reference in the tests (`tests/algorithms/test_formulas.py`).

`group_baselines` (GRPO, RLOO), `returns` (REINFORCE++, GAE, whitening), `kl` (KL estimators),
`policy_losses` (PPO clip and dual clip, GSPO ratio, value, SFT), `off_policy` (TIS, IcePop, MIS).
Reducing per-token values to a loss is left to `algorithms.loss`; which formula a run uses, to
`algorithms.registry`.
"""
