"""The FastAPI server: OpenAI-compatible routes, sessions, metrics (`kvfree serve`)."""
