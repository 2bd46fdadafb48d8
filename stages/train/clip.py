"""The PPO clip's default bounds, which `objective.LossConfig` takes as its own and `sparrow train`'s
--epsilon / --epsilon-high show: torch-free, so the CLI reads them at start-up without importing torch.

The ratio of a token is cut to [1 - CLIP_LOW, 1 + CLIP_HIGH] (TRL's epsilon and epsilon_high, verl's
clip_ratio_low and clip_ratio_high; the high side wider, DAPO's clip-higher)."""

CLIP_LOW = 0.2
CLIP_HIGH = 0.28
