"""Host-side runtime for running PPO stages concurrently.

Owns the generic, model-free pieces: bounded queues between stages, the
worker thread group, versioned weight hand-off with the staleness bound, the
one interruptible deadline wait they share (waiting.py), and
timeline tracing. Importing this package does not import jax or matplotlib.
"""

from pipe_rlhf_jax.runtime.queues import BoundedQueue, PipelineShutdown, QueueClosed
from pipe_rlhf_jax.runtime.tracing import Span, Tracer
from pipe_rlhf_jax.runtime.weights import (
    StalenessGate,
    VersionedWeights,
    WeightsClosed,
    required_version,
)
from pipe_rlhf_jax.runtime.workers import WorkerGroup

__all__ = [
    "BoundedQueue",
    "PipelineShutdown",
    "QueueClosed",
    "Span",
    "StalenessGate",
    "Tracer",
    "VersionedWeights",
    "WeightsClosed",
    "WorkerGroup",
    "required_version",
]
