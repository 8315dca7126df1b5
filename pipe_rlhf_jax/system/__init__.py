"""The PPO system and its schedules.

`system.py` owns the *what* of one PPO iteration (the three stages, the models they hold,
weight sync); `modes.py` owns the *when* (`sequential`, `per_stage`, `pipe`), and
`pipe_loop.py` the `pipe` workers over channels of one process or of several
(`pipe_processes.py`). The generic, model-free machinery they run on (queues, workers,
versioned weights, tracing) lives in `pipe_rlhf_jax.concurrency`; the settings it takes
(`PPOSettings`, `Plan`, `SamplingSettings`) in `pipe_rlhf_jax.config`.
"""

from pipe_rlhf_jax.system.api import PromptSource, RunResult, prompts_from_texts, run
from pipe_rlhf_jax.system.system import Models, PPOSystem

__all__ = ["Models", "PPOSystem", "PromptSource", "RunResult", "prompts_from_texts", "run"]
