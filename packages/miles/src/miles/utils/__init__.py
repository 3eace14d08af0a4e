"""Core utilities shared by the miles command, the rollout side and the train loop."""
