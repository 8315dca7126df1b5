"""The supervised warm-start phases (SFT, reward model) that precede PPO."""
