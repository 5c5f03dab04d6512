"""Request bodies → validated requests: one parser per surface, shared field rules in
params.py and tools.py. Every rejection is a 400 naming the parameter."""
