"""The HTTP edge: the app, its front doors, the one request flow, uvicorn settings."""
