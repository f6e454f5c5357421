"""The FastAPI server: OpenAI-compatible routes and sessions (not built yet)."""
