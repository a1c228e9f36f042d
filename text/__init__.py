"""Text in and out of the engine: tokenizer, chat template, incremental detokenizer
with stop strings, and the output processor that turns engine deltas into
``RequestOutput``s. The API process and the offline ``LLM`` both use it, so there is
one output path. No torch, no aiohttp.
"""
