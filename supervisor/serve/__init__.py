"""Serving: the FastAPI app (server), its auth, health and metrics, the JSON API (api/) and the
web pages (web/). api/ and web/ never import each other; both use serve.auth and the store's
read model. May import app and every stage below it."""
