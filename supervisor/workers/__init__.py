"""Worker management: the pool of resident models, one runner per model (queue, dispatch,
liveness, restarts), the link to each worker process, and the handle a request is tracked by.
It knows nothing of HTTP's routes; the API layer uses it, never the reverse."""
