"""Where a model's files are and what a GGUF file's header says.

The ground floor of the house: every process (API, engine core, worker, the offline
``LLM``) may import it. It needs numpy and ``gguf`` for enum names, never torch.
"""
