"""The phases around PPO: the supervised warm start (SFT, reward model, pairs from the
policy's samples), the reward model's scale under the warm-start policy, the held-out
evaluation before and after PPO, and the end-of-run report."""
