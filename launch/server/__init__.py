"""The HTTP server: OpenAI routes (completions, chat, tokenize, models), Prometheus metrics, CORS, the API key."""
