"""Multi-process (multi-controller) runs: joining the job, global arrays, agreements.

`cluster` joins `jax.distributed` and holds the host-side agreements (primary process,
barriers, values decided by the primary); `arrays` moves data between host batches and
arrays that span processes; `faults` stops every process when one fails; `transfer`
moves versioned weights and queued pytrees between process groups (pipe mode). On one
process everything here is a no-op or the plain single-process call, so the rest of the
code needs no separate path.
"""

from pipe_rlhf_jax.distributed.arrays import fetch, put_global
from pipe_rlhf_jax.distributed.cluster import (
                                               DistributedConfig,
                                               agree,
                                               barrier,
                                               initialize,
                                               is_primary,
                                               listen_host,
                                               process_count,
                                               process_index,
)

__all__ = ["DistributedConfig", "agree", "barrier", "fetch", "initialize", "is_primary",
           "listen_host", "process_count", "process_index", "put_global"]
