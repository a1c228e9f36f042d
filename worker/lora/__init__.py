"""Multi-LoRA in the worker: PEFT adapters read from disk, a host cache of loaded
adapters, device slots stacking the active ones, and the per-step token → slot map."""
