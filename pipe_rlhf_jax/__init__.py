"""pipe_rlhf_jax: computation-mode-aware parallel RLHF (PPO) in JAX.

Per-stage meshes for generation, inference and training; delayed inter-batch pipelined
generation; asynchronous PPO on disjoint sub-meshes. Start at `pipe_rlhf_jax.train.train`
(the main job as a function) or `python -m pipe_rlhf_jax.main --config=configs/quickstart.py`.
Importing the package does no device work.

The package is built in layers (`LAYERS`, lowest first): a module imports its own layer or
lower ones, never a higher one (tests/test_layers.py reads the imports and holds this).
The foundation knows nothing of PPO; the algorithms know no devices' placement; every
typed setting lives in `config`, directly above the algorithms whose registered names it
checks and below everything that reads it; the stages run one algorithm step on a mesh;
the system composes stages into modes; the
phases are the main job's parts (the warm start, PPO's loop, the report) and the typed
experiment they read; `job` runs an experiment whose plan is already chosen; the planner
prices and chooses plans, above everything that runs one, so nothing that runs an
experiment plans; `train` (the library's edge) converts a config into an experiment
once, with the planner, and runs it; the entry points parse command lines.
"""

__version__ = "0.1.0"

LAYERS = (
    ("foundation", ("checks", "host_devices", "metrics", "optim", "checkpoint", "workdir",
                    "parallel", "models", "concurrency", "distributed")),
    ("algorithms", ("ppo", "generation", "data", "envs")),
    ("config", ("config",)),
    ("stages", ("stages",)),
    ("system", ("system",)),
    ("phases", ("phases",)),
    ("job", ("job",)),
    ("planner", ("planner",)),
    ("train", ("train",)),
    ("entry points", ("main", "launch", "plan")),
)
