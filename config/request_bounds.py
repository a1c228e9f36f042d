"""The engine's own hard bounds on a request (SamplingParams enforces them); the API
section's limits may only be stricter."""

ENGINE_MAX_LOGPROBS = 20
ENGINE_MAX_STOP_STRINGS = 16
# No vocabulary Folio serves is larger; the engine core also caps stop_token_ids at the
# model's own vocabulary size.
ENGINE_MAX_STOP_TOKEN_IDS = 262_144
# A grammar (JSON schema, regex, choices, EBNF) travels with every sample of its request
# to the worker; the API's api.max_grammar_chars is usually far smaller.
ENGINE_MAX_GRAMMAR_CHARS = 1 << 20
