"""Request bodies → validated requests: one parser per surface, shared field rules in
api/fields/. Every rejection is a 400 naming the parameter."""
