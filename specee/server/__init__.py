"""`specee serve`: an OpenAI-compatible HTTP server over one engine, with a live page."""
