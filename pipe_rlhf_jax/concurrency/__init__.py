"""Host-side concurrency for running PPO stages at once: threads, queues, weights, traces.

Owns the generic, model-free pieces: bounded queues between stages, the
worker thread group, versioned weight hand-off with the staleness bound, the
one interruptible deadline wait they share (waiting.py), and
timeline tracing. Importing this package does not import jax or matplotlib.
"""

from pipe_rlhf_jax.concurrency.queues import BoundedQueue, PipelineShutdown, QueueClosed
from pipe_rlhf_jax.concurrency.tracing import Span, Tracer
from pipe_rlhf_jax.concurrency.weights import (
    StalenessGate,
    VersionedWeights,
    WeightsClosed,
    required_version,
)
from pipe_rlhf_jax.concurrency.workers import WorkerGroup

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
