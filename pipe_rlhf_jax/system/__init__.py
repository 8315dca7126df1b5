"""The PPO system and its schedules.

`system.py` owns the *what* of one PPO iteration (the three stages, the models they hold,
weight sync); `modes.py` owns the *when* (`sequential`, `per_stage`, `pipe`). The generic,
model-free machinery they run on (queues, workers, versioned weights, tracing) lives in
`pipe_rlhf_jax.runtime`.
"""
