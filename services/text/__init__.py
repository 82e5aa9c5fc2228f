"""Text in and out of the engine: the tokenizer, incremental detokenizing, stop strings and
per-choice output processing. Shared by the gateway and the offline `LLM`, so a served and an
offline completion of the same request read the same; imports no service package."""
