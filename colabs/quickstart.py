# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # pipe_rlhf_jax quickstart: RLHF on a toy task, end to end
#
# This notebook runs the embedded pipeline at a smaller size than
# `python -m pipe_rlhf_jax.main --config=configs/quickstart.py`:
#
# 1. **SFT** of a small byte-level LLaMA-style policy on *noisy* demonstrations of the
#    "reverse" task (`rev abcd=` → `dcba`), so the warm-started policy is mediocre;
# 2. a **Bradley–Terry reward model** trained on preference pairs (closer to the correct
#    reversal is preferred), with its held-out accuracy;
# 3. **PPO** against that reward model, with a KL penalty to the SFT reference.
#
# It was written and run on a CPU-only machine (2 cores, 8 virtual XLA devices); on
# Colab choose any runtime. What you see: the reward curve over PPO steps, and a few
# greedy generations before and after PPO.

# %%
import os
import sys

# Virtual CPU devices must be requested before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
REPO = os.path.abspath(os.path.join(os.getcwd(), "..")) if os.path.basename(
    os.getcwd()) == "colabs" else os.getcwd()
sys.path.insert(0, REPO)

import jax  # noqa: E402

from configs import quickstart  # noqa: E402
from pipe_rlhf_jax.train import train  # noqa: E402

print(jax.devices())

# %% [markdown]
# ## A smaller config
# `NOTEBOOK_SCALE` (an environment variable) picks the size: `small` (default, a couple
# of minutes on CPU) or `tiny` (seconds; what the test suite executes).

# %%
SCALE = os.environ.get("NOTEBOOK_SCALE", "small")
config = quickstart.get_config("tiny" if SCALE == "tiny" else "")
config.plan.mode = "sequential"
if SCALE != "tiny":
  config.sft.steps = 150
  config.reward_model.steps = 150
  config.ppo.steps = 20
workdir = os.path.join(REPO, "runs", f"colab-{SCALE}")
result = train(config, workdir, resume=os.path.isdir(os.path.join(workdir, "checkpoints")),
               progress=False)
print(result.summary)

# %% [markdown]
# ## The reward curve
# Mean reward-model score of each PPO batch (the rule-based accuracy of the reversal is
# logged next to it as `rule_reward/mean`, never optimised).

# %%
import matplotlib.pyplot as plt  # noqa: E402

steps = [r["step"] for r in result.ppo_metrics]
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(steps, [r["reward/mean"] for r in result.ppo_metrics], label="reward model")
ax.plot(steps, [r.get("rule_reward/mean", float("nan")) for r in result.ppo_metrics],
        label="rule: reverse accuracy")
ax.set_xlabel("PPO step")
ax.legend()
plt.show()

# %% [markdown]
# ## Generations before and after PPO (greedy)

# %%
print("before PPO:")
for line in result.samples_before:
  print("  ", line)
print("after PPO:")
for line in result.samples_after:
  print("  ", line)
