"""The RL algorithm: which loss and advantage estimator a run uses, their settings, the formulas.

`registry` (`LOSSES`, `ESTIMATORS`: every loss and estimator by name), `loss_config` (`LossConfig`,
checked against the registry), `formulas` (pure tensor functions), `advantages` (each built-in
estimator's shaper and rule), `loss` (the built-in losses and their reduction), `algorithm`
(`Algorithm`: a config resolved to its entries), and `distillation` and `teacher_kl` (on-policy
distillation). Each imports only modules listed before it; `registry`, `loss_config`,
`algorithm` and `distillation` import no torch.
"""
