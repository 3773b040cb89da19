"""The OpenAI-compatible server: protocol (schemas), serving_* (endpoints), api_server (app)."""
