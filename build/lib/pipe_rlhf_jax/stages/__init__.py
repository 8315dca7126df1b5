"""The three PPO stages (generate, infer, train), each on its own mesh and layout."""
