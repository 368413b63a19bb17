"""Text in and out: the tokenizer and chat format, the sandboxed template renderer, tool-call formats."""
