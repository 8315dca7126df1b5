"""Generation: the sampling distribution, the KV-cache decoder, and the delayed
inter-batch pipelined decoder with its pure schedule."""

from pipe_rlhf_jax.generation.pipelined import pipelined_generate
from pipe_rlhf_jax.generation.sampler import GenerationOutput, SamplingSettings, generate

__all__ = ["GenerationOutput", "SamplingSettings", "generate", "pipelined_generate"]
