"""The OpenAI-compatible server: engine (slots, queue; no HTTP), request rules, text, the app, Ray Serve."""
