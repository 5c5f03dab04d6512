"""`mlxctl`: the admin client (client.py), its tables (format.py) and the service
installer for launchd and systemd (service.py). It talks to a running mlxd over HTTP."""
