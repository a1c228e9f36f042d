"""Tensor parallelism on torch.distributed: the rank group, how a model splits over it,
the per-step broadcast from rank 0 and the loop the other ranks run."""
