"""The text wing: the tokenizer and incremental detokenizer, a choice's text output cut at stop strings, and
structured output's grammars (compiled with llguidance)."""
