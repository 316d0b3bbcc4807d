"""`inkling2 serve`: the OpenAI-compatible server."""
