"""Speculative decoding, the engine core's side: which requests verify how many draft
tokens (adaptive per request), n-gram drafts, and what verification does to progress
and KV blocks. The worker verifies (worker/rejection_sampler.py) and runs draft models
(worker/draft_runner.py)."""
