"""HTTP API routers (FastAPI). Each module exposes a router factory; the app assembles them."""
