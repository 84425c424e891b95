"""`specee serve --replicas N`: the same OpenAI app on N engines, as a Ray Serve application.

An ingress deployment takes every HTTP request, routes it (`router`) to a replica deployment, and
relays the answer; each replica runs the whole single-process app (`specee.server.app`) in process
(`asgi`), so every route, status and error shape is the plain server's. Replicas report their
metrics and slots to the ingress, which serves them labelled by replica (`metrics`)."""
