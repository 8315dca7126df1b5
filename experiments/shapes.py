"""The toy model sizes the PPO-step benchmarks measure, as literals only.

Owns `SIZES`, read by `experiments.bench_ppo_step`, `experiments.fit_elementwise` and the
peer benchmark `experiments.bench_peer_tunix`. The last runs in tunix's own virtual
environment, without this project's package or jax of its version, so this module imports
nothing.
"""

# (layers, embed, heads, kv_heads, mlp, vocab; batch, prompt, gen): the first two are also
# the sizes of the comparison with a peer library (bench_peer_tunix), the third a larger
# one.
SIZES = {
    1: (2, 64, 4, 2, 128, 256, 8, 16, 16),
    2: (4, 256, 8, 4, 512, 512, 16, 32, 32),
    3: (6, 512, 8, 4, 1024, 1024, 16, 64, 64),
    # Wider and deeper, SmolLM2-135M's batch and lengths: the largest size the planner's
    # non-matmul term is fitted on (`fit_elementwise`), in about 10 s a step.
    4: (8, 768, 12, 4, 2048, 8192, 8, 64, 64),
}
