"""The rollout side of miles core: prompt data sources, rollout functions and rewards."""
