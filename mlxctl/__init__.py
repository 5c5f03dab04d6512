"""`mlxctl`: the admin client (client.py), its tables (format.py) and the service
installer for launchd and systemd (service.py). It talks to a running mlxd over HTTP.

A package of its own beside `supervisor/`, not inside it: the client may import the
server's pure modules (its config, token and model catalog), but the server never imports
the client (tests/test_layers.py checks), so the server ships and starts without it."""
