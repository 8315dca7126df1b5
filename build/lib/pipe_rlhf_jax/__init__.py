"""pipe_rlhf_jax: computation-mode-aware parallel RLHF (PPO) in JAX.

Per-stage meshes for generation, inference and training; delayed inter-batch pipelined
generation; asynchronous PPO on disjoint sub-meshes. Start at `pipe_rlhf_jax.train.train`
(the main job as a function) or `python -m pipe_rlhf_jax.main --config=configs/quickstart.py`.
Importing the package does no device work.
"""

__version__ = "0.1.0"
