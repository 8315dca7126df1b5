"""Generation: the sampling distribution, the KV-cache decoder, and the delayed
inter-batch pipelined decoder with its pure schedule."""
